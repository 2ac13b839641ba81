"""Chaos run: `radixserve up --tp 2` under load while random processes are killed or frozen.

    python -m bench.chaos [--duration-s 600] [--model DIR] [--tp 2] [--streams 8] [--seed N]

Load: `--streams` threads each send greedy Generate calls through the gateway, one after another.
Faults: every `--fault-interval-s` (on average) one process of the stack (a worker rank, the
router or the gateway) gets SIGKILL, or SIGSTOP and `--freeze-s` later SIGCONT. After each
fault the run waits for the stack to serve again (the gateway SERVING and a probe answered),
then sends its greedy probes. It prints, per fault: the target and signal, the requests in
flight that failed, how long until serving again, the requests that failed although sent after
that, and whether every probe answered exactly as on the fresh stack; and a summary at the end.
Exits 1 when a probe changed, a request sent after recovery failed, or the stack did not
recover within `--recover-timeout-s`.

Not part of `make test`: `make chaos` runs it (10 minutes by default).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from radixserve.health import is_serving
from radixserve.shared_flags import DEFAULT_MODEL_DIR
from radixserve.stack_plan import free_port
from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc

PROBES = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
)
PROBE_TOKENS = 24
LOAD_PROMPTS = ("Tell me a long story about a dragon.", "Explain how a radix tree works.",
                "Describe the water cycle in detail.", "What happened in 1969?")
LOAD_TOKENS = 64
# How long a load stream waits after a failed call before the next one.
RETRY_PAUSE_S = 1.0
CALL_TIMEOUT_S = 120.0
# Short deadlines, so that faults show within seconds.
FAULT_ENV = {
    "RADIXSERVE_PEER_TIMEOUT_S": "5", "RADIXSERVE_STEP_TIMEOUT_S": "30",
    "RADIXSERVE_COLLECTIVE_TIMEOUT_S": "30", "RADIXSERVE_PROBE_INTERVAL_S": "0.5",
    "RADIXSERVE_RECONNECT_INTERVAL_S": "0.5",
}
TARGETS = ("worker0", "worker1", "router", "gateway")


@dataclass
class Call:
    started: float
    ended: float = 0.0
    code: grpc.StatusCode | None = None


@dataclass
class Fault:
    at: float
    target: str
    sig: str
    failed_in_flight: int = 0
    recovered_s: float | None = None
    failed_after: int = 0
    probes_same: bool | None = None


@dataclass
class Load:
    address: str
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, index: int) -> None:
        prompt = LOAD_PROMPTS[index % len(LOAD_PROMPTS)]
        while not self.stop.is_set():
            call = Call(time.monotonic())
            try:
                generate(self.address, prompt, LOAD_TOKENS)
                call.code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                call.code = exc.code()
                time.sleep(RETRY_PAUSE_S)  # a stack that is down: do not spin
            call.ended = time.monotonic()
            with self.lock:
                self.calls.append(call)

    def failed_between(self, start: float, end: float, *, started_after: bool) -> int:
        """Failed calls that ended in [start, end); `started_after`: only those sent after
        `start`, else only those already in flight at `start`."""
        with self.lock:
            return sum(1 for c in self.calls if c.code != grpc.StatusCode.OK
                       and start <= c.ended < end and (c.started >= start) == started_after)


def generate(address: str, prompt: str, max_tokens: int) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                                     sampling=pb.SamplingParams(temperature=0))
        return [t for r in stub.Generate(request, timeout=CALL_TIMEOUT_S) for t in r.token_ids]


def probe_all(address: str) -> list[list[int]]:
    return [generate(address, prompt, PROBE_TOKENS) for prompt in PROBES]


def serves(address: str) -> bool:
    if not is_serving(address):
        return False
    try:
        generate(address, PROBES[0], 1)
    except grpc.RpcError:
        return False
    return True


def child_pids(log: Path) -> dict[str, int]:
    """The newest pid of each child, from the launcher's "started NAME (pid N)" lines."""
    found = re.findall(r"started (\w+) \(pid (\d+)\)", log.read_text(errors="replace"))
    return {name: int(pid) for name, pid in found}


def wait_for(predicate, timeout_s: float, interval_s: float = 0.25) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval_s)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--fault-interval-s", type=float, default=25.0)
    parser.add_argument("--freeze-s", type=float, default=10.0)
    parser.add_argument("--recover-timeout-s", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    port = free_port()
    address = f"127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="radixserve-chaos-")) / "stack.log"
    print(f"chaos: TP={args.tp}, {args.streams} streams, {args.duration_s:g}s; stack log {log}",
          flush=True)
    with open(log, "wb") as out:
        stack = subprocess.Popen(
            [sys.executable, "-m", "radixserve.launcher", "up", "--model", args.model, "--tp",
             str(args.tp), "--port", str(port), "--http-port", "0", "--metrics-port", "0",
             "--dtype", args.dtype, "--kv-cache-mb", "256", "--max-worker-restarts", "1000",
             "--shutdown-timeout-s", "10"],
            env={**os.environ, **FAULT_ENV}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        if wait_for(lambda: serves(address), args.recover_timeout_s) is None:
            print("chaos: the stack never served", flush=True)
            return 1
        reference = probe_all(address)
        print("chaos: serving; reference probes taken alone on the fresh stack", flush=True)
        return _run(args, rng, address, log, reference)
    finally:
        os.killpg(stack.pid, signal.SIGTERM)
        try:
            stack.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(stack.pid, signal.SIGKILL)


def _run(args, rng: random.Random, address: str, log: Path, reference: list[list[int]]) -> int:
    load = Load(address)
    threads = [threading.Thread(target=load.run, args=(i,), daemon=True) for i in range(args.streams)]
    for thread in threads:
        thread.start()
    faults: list[Fault] = []
    began = time.monotonic()
    try:
        while time.monotonic() - began < args.duration_s:
            time.sleep(rng.uniform(0.5, 1.5) * args.fault_interval_s)
            faults.append(_inject(args, rng, address, log, load, reference))
    finally:
        load.stop.set()
    ok = sum(c.code == grpc.StatusCode.OK for c in load.calls)
    in_flight = sum(f.failed_in_flight for f in faults)
    after = sum(f.failed_after for f in faults)
    refused = len(load.calls) - ok - in_flight - after
    recovered = [f.recovered_s for f in faults if f.recovered_s is not None]
    print(f"chaos: {len(faults)} faults in {time.monotonic() - began:.0f}s; load calls: {ok} ok, "
          f"{in_flight} failed in flight at a fault, {refused} refused while recovering, {after} "
          f"failed although sent after recovery; recovery max {max(recovered, default=0):.1f}s, "
          f"mean {sum(recovered) / max(len(recovered), 1):.1f}s; probes identical after every "
          f"fault: {all(f.probes_same for f in faults)}", flush=True)
    bad = [f for f in faults if not f.probes_same or f.failed_after or f.recovered_s is None]
    return 1 if bad else 0


def _inject(args, rng: random.Random, address: str, log: Path, load: Load,
            reference: list[list[int]]) -> Fault:
    target = rng.choice([t for t in TARGETS if not t.startswith("worker") or int(t[6:]) < args.tp])
    sig = rng.choice(("SIGKILL", "SIGSTOP"))
    pid = child_pids(log)[target]
    fault = Fault(time.monotonic(), target, sig)
    os.kill(pid, getattr(signal, sig))
    if sig == "SIGSTOP":
        time.sleep(args.freeze_s)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # killed by the launcher meanwhile
    fault.recovered_s = wait_for(lambda: serves(address), args.recover_timeout_s)
    recovered_at = time.monotonic()
    if fault.recovered_s is not None:
        fault.recovered_s = recovered_at - fault.at
        try:
            fault.probes_same = probe_all(address) == reference
        except grpc.RpcError as exc:
            print(f"chaos: a probe failed after recovery: {exc.code().name} {exc.details()}")
            fault.probes_same = False
        # Calls sent after recovery get time to end before they are counted.
        time.sleep(min(args.fault_interval_s / 2, 10.0))
    fault.failed_in_flight = load.failed_between(fault.at, time.monotonic(), started_after=False)
    fault.failed_after = load.failed_between(recovered_at, time.monotonic(), started_after=True)
    recovery = "never" if fault.recovered_s is None else f"{fault.recovered_s:.1f}s"
    print(f"chaos: t={fault.at - load_start(load):.0f}s {sig} {target}: {fault.failed_in_flight} "
          f"in-flight failed; serving again after {recovery}; probes identical: "
          f"{fault.probes_same}; failed although sent after recovery: {fault.failed_after}",
          flush=True)
    return fault


def load_start(load: Load) -> float:
    with load.lock:
        return load.calls[0].started if load.calls else time.monotonic()


if __name__ == "__main__":
    sys.exit(main())
