"""The router's Python per step, in one process: the engine and a Stream call over an in-process
worker that answers at once.

    .venv/bin/python -m bench.router_step_cost [--streams 128] [--steps 2000] [--max-tokens 128] [--rounds 5]

What the stack bench's "router ms/step" holds apart from grpc's own cost per message: planning a
step and building its DecodeTask, applying the sampled tokens, the Stream call's events and its
message to the gateway, and opening the next request when one finishes (as the load generator
does). The worker is `bench.fake_worker_group`'s, called in place; the task is serialized and the
result parsed, as grpc would, and the fake's own time is taken out, as is the reading of the
messages and the building of the requests the gateway would do. Thread CPU time, so the
figure holds on a busy machine better than the stack bench's; pair it with a checkout of the code
before a change (run this file from that checkout's root: `python -m bench.router_step_cost`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bench.fake_worker_group import DEFAULT_MODEL, DEVICE, FakeWorkerGroup, text_token_ids
from radixserve.v1 import router_pb2, worker_pb2
from router_service.config import RouterConfig
from router_service.engine import Engine
from router_service.request_stream import RequestStream

WORKER_ADDRESS = "in-process:1"  # never dialled: the engine gets the fake group (a host:port, as the config checks)
PROMPT_LEN = 40  # tokens of each request's prompt (distinct prompts: no cache hits to speak of)


class InProcessGroup:
    """`WorkerGroup`'s interface over a `FakeWorkerGroup` called in place, with no step time."""

    def __init__(self, fake: FakeWorkerGroup) -> None:
        self.fake = fake
        self.broken = asyncio.Event()
        self.addresses = [WORKER_ADDRESS]
        self._results: list[worker_pb2.TaskResult] = []
        self.fake_s = 0.0  # thread CPU spent in the fake (taken out of the figures)

    async def connect(self) -> list[worker_pb2.GetWorkerInfoResponse]:
        return [await self.fake.GetWorkerInfo(None, None)]

    async def send(self, task: worker_pb2.DecodeTask, timeout_s: float) -> None:
        data = task.SerializeToString()
        started = time.thread_time()
        result = self.fake.run(worker_pb2.DecodeTask.FromString(data)).SerializeToString()
        self.fake_s += time.thread_time() - started
        self._results.append(worker_pb2.TaskResult.FromString(result))
        await asyncio.sleep(0)  # a turn of the loop, as a write is

    async def receive(self, task: worker_pb2.DecodeTask, timeout_s: float) -> worker_pb2.TaskResult:
        await asyncio.sleep(0)
        return self._results.pop(0)

    async def execute(self, task: worker_pb2.DecodeTask, timeout_s: float) -> worker_pb2.TaskResult:
        await self.send(task, timeout_s)
        return await self.receive(task, timeout_s)

    async def close(self) -> None:
        pass


async def measure(streams: int, steps: int, max_tokens: int, model: str, bare_tokens: bool) -> tuple[float, float]:
    """(router CPU us per step, tokens per step) over `steps` steps after a warm-up."""
    token_ids, vocab_size, eos = text_token_ids(model)
    fake = FakeWorkerGroup(0.0, token_ids, vocab_size, eos)
    config = RouterConfig(workers=(WORKER_ADDRESS,), max_running_requests=streams, overlap=None)
    engine = Engine(config)
    group = InProcessGroup(fake)
    engine.group = group  # type: ignore[assignment]
    stop = asyncio.Event()
    runner = asyncio.create_task(engine.run(stop))
    while engine.scheduler is None:
        await asyncio.sleep(0.001)
    assert engine.overlap, f"the fake reports device {DEVICE!r}: overlap should be on"
    stream = RequestStream(engine, bare_tokens)
    opened = 0
    caller_s = 0.0  # thread CPU of the caller's part: reading messages, building requests

    def open_one() -> None:
        nonlocal opened, caller_s
        started = time.thread_time()
        prompt = [(opened * 7 + i) % (vocab_size - 1) + 1 for i in range(PROMPT_LEN)]
        message = router_pb2.RouterGenerateRequest(
            request_id=f"r{opened}", prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
        caller_s += time.thread_time() - started
        stream.open(message)
        opened += 1

    for _ in range(streams):
        open_one()
    warmup = steps // 4
    marks: dict[str, tuple[float, float, int]] = {}
    tokens = 0

    def mark(name: str) -> None:
        marks[name] = (time.thread_time(), group.fake_s + caller_s, tokens)

    num_steps = 0
    async for message in stream.responses():
        started = time.thread_time()
        num_steps += 1
        tokens += len(message.bare_token_ids)
        ended = 0
        for update in message.updates:
            tokens += len(update.response.token_ids)
            if update.response.finish_reason or update.error_code:
                ended += 1
        caller_s += time.thread_time() - started
        for _ in range(ended):
            open_one()
        if num_steps == warmup:
            mark("start")
        if num_steps == warmup + steps:
            mark("end")
            break
    stop.set()
    stream.close()
    engine._wakeup.set()  # noqa: SLF001 (the loop waits on it when idle)
    await asyncio.wait_for(runner, 10)
    (cpu0, fake0, tok0), (cpu1, fake1, tok1) = marks["start"], marks["end"]
    us_per_step = ((cpu1 - cpu0) - (fake1 - fake0)) / steps * 1e6  # less the fake's and the caller's
    return us_per_step, (tok1 - tok0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--updates-only", action="store_true",
                        help="also measure a caller that does not read bare tokens (every token an update), "
                             "in turns with one that does")
    args = parser.parse_args()
    kinds = [True, False] if args.updates_only else [True]
    figures: dict[bool, list[tuple[float, float]]] = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            figures[kind].append(asyncio.run(measure(args.streams, args.steps, args.max_tokens, args.model, kind)))
    for kind in kinds:
        per_step = [f[0] for f in figures[kind]]
        per_token = [f[0] / f[1] for f in figures[kind]]
        caller = "bare tokens" if kind else "updates only"
        print(f"router Python per step ({caller}), {args.streams} streams, {args.steps} steps x {args.rounds} rounds: "
              f"median {statistics.median(per_step):.0f} us/step (min {min(per_step):.0f}), "
              f"{statistics.median(f[1] for f in figures[kind]):.1f} tokens/step, "
              f"median {statistics.median(per_token):.2f} us/token (min {min(per_token):.2f})")


if __name__ == "__main__":
    main()
