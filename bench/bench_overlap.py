"""Overlap scheduling, measured in one run: what the router and the round trip cost between steps.

    .venv/bin/python -m bench.bench_overlap [--model DIR] [--dtype bfloat16] [--num-threads 2]

1. Router CPU per step at 64 running requests: a fake worker process (no model, answers at
   once) behind a router process; 64 requests decode together; the router process's CPU time
   (user + system, all its threads: gRPC included) over windows of steps, per step, p50 of the
   windows; overlap on and off.
2. The worker alone (`bench_worker.DecodeBench`, in this process, no gRPC) at batch 1 and 32:
   its decode step time at the same context as the stack's requests (best of --repeats).
3. Through the stack (worker, router and gateway processes; one stack per mode, so that the
   modes take turns --rounds times): --batches 1 and 32 requests sent at once through the
   gateway; inter-token latency p50 over all their tokens after the first, and the workers' own
   idle time between consecutive steps (p50, as the router's GetStats reports it: measured on
   the worker), overlap off and on. Fresh routers and gateways serve each batch size, so each
   idle figure covers only its own steps.
0. What the other ranks pay to learn rank 0's tokens at TP=2: one broadcast of the referred ids
   (gloo, two processes on this machine), at --batches ids.
The issue's goals are checked at the end: idle p50 under 0.3 ms with overlap on, stack ITL
within 3% of the worker's step time, router CPU per step p50 under 1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from bench.processes import Processes, cpu_seconds, free_port, wait_serving  # noqa: E402
from bench.bench_worker import DEFAULT_MODEL, PAGE_SIZE, DecodeBench, kv_budget, runner_shape  # noqa: E402
from radixserve.serving import CHANNEL_OPTIONS  # noqa: E402
from radixserve.v1 import generation_pb2, generation_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2  # noqa: E402
from worker_service.model_runner import ModelRunner, RunnerConfig  # noqa: E402

FAKE_WORKER = ROOT / "tests" / "router" / "fake_worker.py"
PYTHON = sys.executable
READY_TIMEOUT_S = 300.0
# Goals of issue 16.
IDLE_GOAL_S = 0.3e-3
ITL_GOAL = 1.03
ROUTER_CPU_GOAL_S = 1e-3
NUM_RUNNING = 64
CPU_WINDOW_S = 0.25


def start_router(procs: Processes, name: str, workers: str, overlap: bool, extra: list[str]) -> tuple[str, subprocess.Popen]:
    port = free_port()
    proc = procs.start(name, [
        PYTHON, "-m", "router_service", "--port", str(port), "--workers", workers,
        "--metrics-port", "0", "--log-level", "WARNING", "--overlap" if overlap else "--no-overlap", *extra,
    ])
    return f"127.0.0.1:{port}", proc


# ---- 0. the broadcast that resolves referred tokens at TP=2 --------------------------------

def _broadcast_rank(rank: int, port: int, num_ids: int, rounds: int, out: "multiprocessing.Queue") -> None:
    import torch.distributed as dist

    from worker_service.distributed import TPGroup, broadcast_ids

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = TPGroup(rank, 2)
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        broadcast_ids(list(range(num_ids)), group, "cpu")
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def broadcast_cost_s(num_ids: int, rounds: int) -> float:
    """Median time of `worker_service.distributed.broadcast_ids` of `num_ids` ids over gloo
    between two processes on this machine."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_broadcast_rank, args=(rank, port, num_ids, rounds, out)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while out.empty():
            if time.monotonic() > deadline or not all(process.is_alive() for process in ranks):
                raise RuntimeError("the broadcast ranks failed or did not finish")
            time.sleep(0.1)
        return out.get()
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


# ---- 1. router CPU per step ----------------------------------------------------------------

async def router_cpu_per_step(procs: Processes, worker: str, overlap: bool, seconds: float) -> tuple[list[float], float]:
    """Per-step CPU seconds of the router process over windows of `CPU_WINDOW_S` while
    `NUM_RUNNING` requests decode, and the engine's own p50 (GetStats: planning and applying
    steps on the event loop, without gRPC's threads and the callers' stream handlers)."""
    address, proc = start_router(procs, f"router-cpu-{overlap}", worker, overlap,
                                 ["--max-running-requests", str(NUM_RUNNING)])
    try:
        await wait_serving(address, proc)
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            calls = [stub.Generate(router_pb2.RouterGenerateRequest(
                prompt_token_ids=[3 + i % 60, 4, 5, 6], max_tokens=3000, ignore_eos=True,
                sampling=worker_pb2.ResolvedSamplingParams(top_p=1.0, repetition_penalty=1.0),
            ), timeout=600) for i in range(NUM_RUNNING)]
            readers = [asyncio.ensure_future(_drain(call)) for call in calls]
            while (await stub.GetStats(router_pb2.GetStatsRequest())).num_running < NUM_RUNNING:
                await asyncio.sleep(0.05)
            per_step = []
            steps, cpu = (await stub.GetStats(router_pb2.GetStatsRequest())).num_steps, cpu_seconds(proc.pid)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                await asyncio.sleep(CPU_WINDOW_S)
                stats = await stub.GetStats(router_pb2.GetStatsRequest())
                now_cpu = cpu_seconds(proc.pid)
                if stats.num_steps > steps:
                    per_step.append((now_cpu - cpu) / (stats.num_steps - steps))
                steps, cpu = stats.num_steps, now_cpu
            for call in calls:
                call.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            return per_step, stats.router_step_cpu_p50_s
    finally:
        procs.stop(f"router-cpu-{overlap}")


async def _drain(call) -> None:
    async for _ in call:
        pass


# ---- 2. the worker alone -------------------------------------------------------------------

def worker_step_s(model: Path, dtype: str, batch: int, context: int, repeats: int, steps: int) -> float:
    """Seconds per decode step of `batch` sequences at `context` tokens (best of `repeats`)."""
    args = argparse.Namespace(context=context, steps=steps, repeats=repeats, batch=[batch])
    runner = ModelRunner(RunnerConfig(
        model_dir=model, device="cpu", dtype=dtype, page_size=PAGE_SIZE,
        kv_cache_bytes=kv_budget(runner_shape(model), dtype, args), rank=0, world_size=1,
    ))
    bench = DecodeBench(runner, batch, context, steps, repeats)
    best = max(bench.run() for _ in range(repeats))  # tokens/s
    return batch / best


# ---- 3. through the stack ------------------------------------------------------------------

class Stack:
    """Router and gateway processes (overlap on or off) in front of their own worker."""

    def __init__(self, procs: Processes, model: Path, worker: str, overlap: bool, tag: str) -> None:
        self.tag = tag
        self.router, self._router_proc = start_router(procs, f"router-{tag}", worker, overlap, [])
        gateway_port = free_port()
        self._gateway_proc = procs.start(f"gateway-{tag}", [
            PYTHON, "-m", "gateway_service", "--port", str(gateway_port), "--routers", self.router,
            "--model", str(model), "--metrics-port", "0", "--http-port", "0", "--log-level", "WARNING",
        ])
        self.gateway = f"127.0.0.1:{gateway_port}"

    async def ready(self) -> None:
        await wait_serving(self.router, self._router_proc)
        await wait_serving(self.gateway, self._gateway_proc)

    async def itl_gaps(self, batch: int, prompt_words: int, max_tokens: int, seed: int) -> list[float]:
        """`batch` requests sent at once through the gateway: every gap between two tokens."""
        async with grpc.aio.insecure_channel(self.gateway, options=CHANNEL_OPTIONS) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)

            async def one(index: int) -> list[float]:
                words = " ".join(f"w{seed}x{index}x{k}" for k in range(prompt_words))
                times = []
                async for chunk in stub.Generate(generation_pb2.GenerateRequest(
                    prompt=words, max_tokens=max_tokens, ignore_eos=True,
                    sampling=generation_pb2.SamplingParams(temperature=0.0),
                ), timeout=900):
                    times.extend([time.monotonic()] * len(chunk.token_ids))
                return times

            streams = await asyncio.gather(*(one(i) for i in range(batch)))
        return [b - a for times in streams for a, b in zip(times, times[1:])]

    async def stats(self) -> router_pb2.GetStatsResponse:
        async with grpc.aio.insecure_channel(self.router, options=CHANNEL_OPTIONS) as channel:
            return await router_pb2_grpc.RouterServiceStub(channel).GetStats(router_pb2.GetStatsRequest())

    def stop(self, procs: Processes) -> None:
        procs.stop(f"gateway-{self.tag}")
        procs.stop(f"router-{self.tag}")


async def stacks_interleaved(procs: Processes, args: argparse.Namespace, workers: dict[bool, str],
                             batch: int) -> dict[bool, tuple[list[list[float]], router_pb2.GetStatsResponse]]:
    """Overlap off and on take turns, `args.rounds` rounds each, on fresh routers (so GetStats'
    idle median covers this batch only); returns per mode the ITL gaps of each round and the
    router's stats after the last."""
    stacks = {overlap: Stack(procs, args.model, workers[overlap], overlap, f"{'on' if overlap else 'off'}-{batch}")
              for overlap in (False, True)}
    try:
        for stack in stacks.values():
            await stack.ready()
            await stack.itl_gaps(1, args.prompt_words, 4, seed=-1)  # first-use costs out of the way
        rounds: dict[bool, list[list[float]]] = {False: [], True: []}
        for index in range(args.rounds):
            for overlap in (False, True):
                rounds[overlap].append(await stacks[overlap].itl_gaps(batch, args.prompt_words, args.max_tokens, index))
        return {overlap: (rounds[overlap], await stacks[overlap].stats()) for overlap in (False, True)}
    finally:
        for stack in stacks.values():
            stack.stop(procs)


async def main_async(args: argparse.Namespace) -> None:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-overlap-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"process logs in {log_dir}")
    procs = Processes(log_dir)
    with ExitStack() as cleanup:
        cleanup.callback(procs.close)
        # 0.
        for num_ids in args.batches:
            cost = broadcast_cost_s(num_ids, rounds=200)
            print(f"TP=2 broadcast of {num_ids} referred token ids (gloo, 2 processes): median {cost * 1e3:.3f} ms")
        # 1.
        fake_port = free_port()
        fake = procs.start("fake-worker", [PYTHON, str(FAKE_WORKER), "--port", str(fake_port),
                                           "--num-pages", "16000", "--page-size", str(PAGE_SIZE)])
        await wait_serving(f"127.0.0.1:{fake_port}", fake)
        cpu = {}
        for overlap in (False, True):
            cpu[overlap] = await router_cpu_per_step(procs, f"127.0.0.1:{fake_port}", overlap, args.cpu_seconds)
        procs.stop("fake-worker")
        print(f"router CPU per step, {NUM_RUNNING} running requests, fake worker "
              f"(process: user + system over {len(cpu[True][0])} windows of {CPU_WINDOW_S}s; "
              f"engine: its GetStats p50):")
        for overlap in (False, True):
            windows, engine_p50 = cpu[overlap]
            print(f"  overlap {'on ' if overlap else 'off'}: process p50 {statistics.median(windows) * 1e3:.3f} ms "
                  f"(min {min(windows) * 1e3:.3f}, max {max(windows) * 1e3:.3f}); "
                  f"engine p50 {engine_p50 * 1e3:.3f} ms")
        if args.skip_model:
            return
        # 2. and 3.: one worker per mode, so that the two modes can take turns.
        torch.set_num_threads(args.num_threads)
        context = args.prompt_tokens + args.max_tokens // 2
        alone = {b: worker_step_s(args.model, args.dtype, b, context, args.repeats, args.steps)
                 for b in args.batches}
        workers = {}
        for overlap in (False, True):
            port = free_port()
            name = f"worker-{'on' if overlap else 'off'}"
            proc = procs.start(name, [
                PYTHON, "-m", "worker_service", "--model", str(args.model), "--port", str(port),
                "--dtype", args.dtype, "--num-threads", str(args.num_threads), "--metrics-port", "0",
                "--kv-cache-mb", str(args.kv_cache_mb), "--log-level", "WARNING",
            ])
            workers[overlap] = f"127.0.0.1:{port}"
            await wait_serving(workers[overlap], proc)
        results = {batch: await stacks_interleaved(procs, args, workers, batch) for batch in args.batches}
        print(f"\nworker alone vs through the stack ({args.dtype}, {args.num_threads} thread(s), "
              f"~{context}-token context, {args.max_tokens} tokens per request, {args.rounds} rounds "
              f"per mode taking turns):")
        print(f"{'batch':>5} {'mode':>4} {'worker step ms':>14} {'stack ITL p50 ms':>17} {'ITL/step':>9} "
              f"{'round ITL p50s ms':>24} {'worker idle p50 ms':>19} {'steps':>6}")
        for batch in args.batches:
            for overlap in (False, True):
                rounds, stats = results[batch][overlap]
                itl = statistics.median([gap for gaps in rounds for gap in gaps])
                per_round = " ".join(f"{statistics.median(gaps) * 1e3:.1f}" for gaps in rounds)
                print(f"{batch:>5} {'on' if overlap else 'off':>4} {alone[batch] * 1e3:14.2f} {itl * 1e3:17.2f} "
                      f"{itl / alone[batch]:9.3f} {per_round:>24} {stats.worker_idle_p50_s * 1e3:19.3f} "
                      f"{stats.num_idle_measured_steps:6d}")
        print("\ngoals (overlap on):")
        for batch in args.batches:
            (off_rounds, off_stats), (on_rounds, on_stats) = results[batch][False], results[batch][True]
            itl_on = statistics.median([gap for gaps in on_rounds for gap in gaps])
            itl_off = statistics.median([gap for gaps in off_rounds for gap in gaps])
            idle = on_stats.worker_idle_p50_s
            print(f"  batch {batch}: worker idle p50 {idle * 1e3:.3f} ms (off: {off_stats.worker_idle_p50_s * 1e3:.3f} ms), "
                  f"goal < {IDLE_GOAL_S * 1e3:.1f} ms: {'met' if idle < IDLE_GOAL_S else 'NOT met'}; "
                  f"ITL {itl_on / alone[batch]:.3f}x the worker's step (off: {itl_off / alone[batch]:.3f}x; "
                  f"on/off {itl_on / itl_off:.3f}), goal <= {ITL_GOAL}: "
                  f"{'met' if itl_on / alone[batch] <= ITL_GOAL else 'NOT met'}")
        windows, engine_p50 = cpu[True]
        for what, p50 in (("engine", engine_p50), ("whole process", statistics.median(windows))):
            print(f"  router CPU per step ({what}) p50 {p50 * 1e3:.3f} ms, goal < "
                  f"{ROUTER_CPU_GOAL_S * 1e3:.0f} ms: {'met' if p50 < ROUTER_CPU_GOAL_S else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads of the worker (1: see docs/benchmarks.md on threads under load)")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    parser.add_argument("--prompt-words", type=int, default=60, help="words per prompt (~2 tokens each)")
    parser.add_argument("--prompt-tokens", type=int, default=150, help="the prompt's tokens, for the worker-alone context")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per mode and batch, the modes taking turns")
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--cpu-seconds", type=float, default=4.0)
    parser.add_argument("--skip-model", action="store_true", help="only the router CPU figure")
    parser.add_argument("--log-dir", default=None, help="the processes' logs (default: a new temporary folder)")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
