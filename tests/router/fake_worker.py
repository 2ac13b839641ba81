"""A fake worker rank: a real grpc.aio `WorkerService` over `FakeModel`.

In-process: `await start_fake_worker(...)`. As a process (for fault tests):
`python tests/router/fake_worker.py --port P [--rank R --world-size N --num-pages K ...]`.
Every rank validates and applies every task on its own fake KV pool (so ranks that were sent
different tasks would diverge); rank 0 returns the sampled tokens, the others acknowledge.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

if __package__ in (None, ""):  # run as a script: make `router.*` and the project importable
    sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

from radixserve.serving import start_server  # noqa: E402
from radixserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402
from router.fake_model import EOS_TOKEN_ID, VOCAB_SIZE, FakeEntry, FakeModel, FakeTaskError  # noqa: E402

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name


def fake_logprob(token_id: int) -> float:
    """The log probability the fake reports for a token (tests check it passes through)."""
    return -token_id / 100.0


class FakeWorker(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(
        self,
        *,
        rank: int = 0,
        world_size: int = 1,
        num_pages: int = 64,
        page_size: int = 4,
        eos_every: int = 0,
        context_len: int = 4096,
        step_delay_s: float = 0.0,
        device: str = "cpu",
    ) -> None:
        self.device = device  # what GetWorkerInfo reports (the router's --overlap default reads it)
        self.rank = rank
        self.world_size = world_size
        self.context_len = context_len
        self.step_delay_s = step_delay_s
        self.model = FakeModel(num_pages, page_size, eos_every)
        self.wants_logprobs: dict[str, bool] = {}
        self.errors: list[str] = []  # every rejected task, for tests to assert on
        # The last applied task and the tokens it sampled: what `sampled_in_task` refers to.
        # Every fake rank computes them (the real ranks get them from rank 0's broadcast).
        self.last_task_id = 0
        self.last_sampled: dict[str, int] = {}
        self.num_resolved = 0  # entries that referred to a token not sent (overlap)

    async def GetWorkerInfo(self, request, context) -> worker_pb2.GetWorkerInfoResponse:
        return worker_pb2.GetWorkerInfoResponse(
            rank=self.rank,
            world_size=self.world_size,
            model_name="fake",
            dtype="float32",
            page_size=self.model.page_size,
            num_pages=self.model.num_pages,
            context_len=self.context_len,
            vocab_size=VOCAB_SIZE,
            eos_token_ids=[EOS_TOKEN_ID],
            device=self.device,
        )

    async def Execute(
        self, request_iterator: AsyncIterator[worker_pb2.DecodeTask], context
    ) -> AsyncIterator[worker_pb2.TaskResult]:
        finished = None
        async for task in request_iterator:
            started = time.monotonic()
            if self.step_delay_s:
                await asyncio.sleep(self.step_delay_s)
            result = self.run_task(task)
            if finished is not None:
                result.idle_before_s = started - finished
            finished = time.monotonic()
            yield result

    def _resolve(self, entry: worker_pb2.TaskEntry) -> list[int]:
        """The entry's tokens, with the one it refers to (overlap) in front."""
        if not entry.sampled_in_task:
            return list(entry.token_ids)
        if entry.sampled_in_task != self.last_task_id or entry.request_id not in self.last_sampled:
            raise FakeTaskError(
                f"{entry.request_id}: refers to task {entry.sampled_in_task}'s token, "
                f"last applied task {self.last_task_id}"
            )
        self.num_resolved += 1
        return [self.last_sampled[entry.request_id], *entry.token_ids]

    def run_task(self, task: worker_pb2.DecodeTask) -> worker_pb2.TaskResult:
        result = worker_pb2.TaskResult(task_id=task.task_id, rank=self.rank)
        try:
            return self._run_task(task, result)
        except FakeTaskError as exc:
            self.errors.append(str(exc))
            result.error.code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
            result.error.message = str(exc)
            return result

    def _run_task(self, task: worker_pb2.DecodeTask, result: worker_pb2.TaskResult) -> worker_pb2.TaskResult:
        entries = [
            FakeEntry(
                request_id=entry.request_id,
                token_ids=self._resolve(entry),
                start_position=entry.start_position,
                page_ids=list(entry.page_ids),
                sample=entry.sample,
                new_request=entry.HasField("new_request"),
                cached_token_ids=list(entry.new_request.cached_token_ids),
                num_draft_tokens=entry.num_draft_tokens,
            )
            for entry in task.entries
        ]
        tokens = self.model.execute(task.reset, list(task.release_request_ids), entries)
        sampling = [entry for entry in task.entries if entry.sample]
        self.last_task_id = task.task_id
        self.last_sampled = {entry.request_id: token for entry, token in zip(sampling, tokens)}
        if task.reset:
            self.wants_logprobs.clear()
        for request_id in task.release_request_ids:
            self.wants_logprobs.pop(request_id, None)
        for entry in task.entries:
            if entry.HasField("new_request"):
                self.wants_logprobs[entry.request_id] = entry.new_request.sampling.logprobs
        if self.rank == 0:
            for entry, token_id, accepted in zip(sampling, tokens, self.model.last_accepted):
                wants = self.wants_logprobs[entry.request_id]
                logprob = fake_logprob(token_id) if wants else 0.0
                sampled = result.tokens.add(request_id=entry.request_id, token_id=token_id, logprob=logprob,
                                            num_accepted_drafts=accepted)
                if wants:
                    drafts = list(entry.token_ids)[len(entry.token_ids) - entry.num_draft_tokens:][:accepted]
                    for draft in drafts:
                        sampled.accepted_logprobs.add(token_id=draft, logprob=fake_logprob(draft))
        return result


async def start_fake_worker(host: str = "127.0.0.1", port: int = 0, **kwargs) -> tuple[grpc.aio.Server, int, FakeWorker]:
    """Serve a `FakeWorker` (health SERVING) in this event loop; returns server, port, servicer."""
    worker = FakeWorker(**kwargs)
    server, health, bound = await start_server(
        host, port, [lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, s)],
        [SERVICE_NAME],
    )
    await health.set(True)
    return server, bound, worker


async def _serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server, _, _ = await start_fake_worker(
        port=args.port, rank=args.rank, world_size=args.world_size, num_pages=args.num_pages,
        page_size=args.page_size, eos_every=args.eos_every, step_delay_s=args.step_delay_s,
    )
    await stop.wait()
    await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description="fake radixserve worker rank for router tests")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--num-pages", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=4)
    parser.add_argument("--eos-every", type=int, default=0)
    parser.add_argument("--step-delay-s", type=float, default=0.0)
    asyncio.run(_serve(parser.parse_args()))


if __name__ == "__main__":
    main()
