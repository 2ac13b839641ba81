"""Speculative decoding on vs off: two stacks side by side, the same workloads alternating.

Two `radixserve up` stacks run at once, one with the router's `--speculative` and one with
`--no-speculative` (same model, dtype and KV budget); each workload runs on one, then the other,
in alternating order for `--repeats` rounds with fresh prompts each round, so that both see the
same machine load. Reported per workload: output tokens/s of each (median over rounds), their
ratio, and from the speculating router's GetStats: the acceptance rate (accepted / drafted) and
the tokens a verifying entry yields on average (1 + accepted / entries).

    python -m bench.bench_speculation --workloads quote_edit,single_stream --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc

from bench import workloads as wl
from bench.loadgen import run_workload, wait_serving
from bench.records import summarize
from bench.report import speculation
from radixserve.flags import env_name
from radixserve.serving import CHANNEL_OPTIONS
from radixserve.v1 import router_pb2, router_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
# Ports of the two stacks: gateway P, router P + 1, worker ranks P + 9 + r (the launcher's plan).
PORT_STRIDE = 20
# Workload variants of this benchmark start here, apart from run_all's own runs.
VARIANT_BASE = 5000

# name -> (workload for a variant, concurrency) for each job.
JobBuilder = Callable[[int], wl.Workload]


def jobs(args: argparse.Namespace) -> list[tuple[JobBuilder, int]]:
    """The quote-and-edit workload and run_all's workloads, at run_all's concurrencies."""
    num = args.num_requests
    found: list[tuple[JobBuilder, int]] = [(lambda v: wl.quote_edit(args.quote_edit_tokens, v), 1)]
    for c in args.concurrency:
        n = num or max(8, 2 * c)
        found.append((lambda v, n=n: wl.shared_system_prompt(n, args.max_tokens, variant=v), c))
        found.append((lambda v, n=n: wl.distinct_prompts(n, args.max_tokens, variant=v), c))
    found.append((lambda v: wl.single_stream(args.single_stream_tokens, v), 1))
    found.append((lambda v: wl.multi_turn(4, 4, args.max_tokens, v), 4))
    wanted = set(args.workloads)
    return [(build, c) for build, c in found if not wanted or build(0).name in wanted]


def start_stack(args: argparse.Namespace, port: int, speculative: bool) -> subprocess.Popen:
    cmd = [str(ROOT / ".venv" / "bin" / "radixserve"), "up", "--model", args.model, "--tp", str(args.tp),
           "--port", str(port), "--http-port", "0", "--metrics-port", "0", "--dtype", args.dtype,
           "--kv-cache-mb", str(args.spec_kv_cache_mb)]
    env = {**os.environ, env_name("speculative"): "true" if speculative else "false"}
    print(f"[spec] starting ({'on' if speculative else 'off'}): {' '.join(cmd)}", flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True,
                            stdout=None if args.verbose else subprocess.DEVNULL)


async def router_stats(address: str) -> router_pb2.GetStatsResponse:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        return await router_pb2_grpc.RouterServiceStub(channel).GetStats(router_pb2.GetStatsRequest(), timeout=30)


def run_pairs(args: argparse.Namespace, on_port: int, off_port: int) -> list[dict]:
    results = []
    addresses = {"on": f"127.0.0.1:{on_port}", "off": f"127.0.0.1:{off_port}"}
    router_on = f"127.0.0.1:{on_port + 1}"
    for build, concurrency in jobs(args):
        rates: dict[str, list[float]] = {"on": [], "off": []}
        drafted = accepted = entries = 0
        name = build(0).name
        for round_index in range(args.spec_repeats):
            workload = build(VARIANT_BASE + round_index)
            order = ("on", "off") if round_index % 2 == 0 else ("off", "on")
            for side in order:
                before = asyncio.run(router_stats(router_on)) if side == "on" else None
                records, wall_s = asyncio.run(run_workload(addresses[side], workload, concurrency, args.time_limit_s))
                summary = summarize(records, wall_s)
                rates[side].append(summary["output_tokens_per_s"])
                if before is not None:
                    after = asyncio.run(router_stats(router_on))
                    drafted += after.num_draft_tokens - before.num_draft_tokens
                    accepted += after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
                    entries += after.num_draft_entries - before.num_draft_entries
        on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
        result = {
            "workload": name, "concurrency": concurrency,
            "on_tokens_per_s": round(on, 2), "off_tokens_per_s": round(off, 2),
            "ratio": round(on / off, 3) if off else None,
            "rounds_on": rates["on"], "rounds_off": rates["off"],
            "draft_tokens": drafted, "accepted_draft_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "tokens_per_verify_step": round(1 + accepted / entries, 2) if entries else None,
        }
        print(f"[spec] {name} c={concurrency}: on {result['on_tokens_per_s']} / off "
              f"{result['off_tokens_per_s']} out tok/s = {result['ratio']}x; acceptance "
              f"{result['acceptance_rate']}, tokens per verifying step {result['tokens_per_verify_step']}",
              flush=True)
        results.append(result)
    return results


def run(args: argparse.Namespace) -> dict:
    """Both stacks up, every job paired, both stacks down; the results."""
    on_port, off_port = args.spec_port, args.spec_port + PORT_STRIDE
    # SIGTERM (a timeout) must still run the `finally` below, which stops both stacks.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit("[spec] terminated"))
    procs = [start_stack(args, on_port, True), start_stack(args, off_port, False)]
    try:
        for port, proc in zip((on_port, off_port), procs):
            asyncio.run(wait_serving(f"127.0.0.1:{port}", proc, args.startup_timeout_s))
            asyncio.run(run_workload(f"127.0.0.1:{port}", wl.single_stream(4), 1, args.time_limit_s))
        return {"dtype": args.dtype, "repeats": args.spec_repeats, "results": run_pairs(args, on_port, off_port)}
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
        signal.signal(signal.SIGTERM, previous)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options this benchmark adds (run_all shares the workload ones)."""
    parser.add_argument("--spec-port", type=int, default=50400,
                        help="gateway port of the speculating stack (the other stack: +20)")
    parser.add_argument("--spec-repeats", type=int, default=2,
                        help="alternating rounds of each workload on both stacks")
    parser.add_argument("--spec-kv-cache-mb", type=int, default=512,
                        help="KV budget of each of the two stacks")
    parser.add_argument("--quote-edit-tokens", type=int, default=256, help="output tokens of quote_edit")
    parser.add_argument("--workloads", type=lambda s: [w for w in s.split(",") if w], default=[],
                        help="comma-separated workload names to pair (default: all)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--single-stream-tokens", type=int, default=256)
    parser.add_argument("--num-requests", type=int, default=0)
    parser.add_argument("--time-limit-s", type=float, default=180.0)
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--verbose", action="store_true")
    add_arguments(parser)
    spec = run(parser.parse_args())
    print("\n".join(speculation({"speculation": spec})), flush=True)


if __name__ == "__main__":
    main()
