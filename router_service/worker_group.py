"""The connection to the worker ranks: one channel and one `Execute` stream per rank.

Every task goes to every rank, in the same order; a step completes when every rank answered.
Anything that goes wrong on any rank (a broken stream, a rank that is gone or does not answer
within the step deadline, ranks that disagree) raises `WorkerFault`: the ranks may disagree about
requests afterwards, so the only safe way on is to reconnect and reset them all. The exception is
`TaskRejected`: every rank refused the task, and a rank applies a task whole or not at all, so
all of them are still where they were before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Iterable, Iterator
from typing import TypeVar

import grpc

from radixserve.security import Security
from radixserve.serving import CHANNEL_OPTIONS, NO_SECURITY
from radixserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")


class WorkerFault(Exception):
    """A rank failed or disagreed; the group must be reconnected."""


class TaskRejected(Exception):
    """Every rank answered the task with an error: none of them applied it."""


class WorkerGroup:
    """Channels use TLS and calls carry the internal token as `security` says."""

    def __init__(
        self, addresses: tuple[str, ...], connect_timeout_s: float, security: Security = NO_SECURITY
    ) -> None:
        self.addresses = addresses
        self.connect_timeout_s = connect_timeout_s
        self._security = security
        self._metadata = security.call_metadata()
        # Set when a stream of the current connection ends (e.g. a rank died while idle).
        self.broken = asyncio.Event()
        self._channels: list[grpc.aio.Channel] = []
        self._calls: list[grpc.aio.StreamStreamCall] = []

    async def connect(self) -> list[worker_pb2.GetWorkerInfoResponse]:
        """Ask every rank for its info, check they form one group, open their streams."""
        await self.close()
        self.broken.clear()
        self._channels = [
            self._security.aio_channel(address, CHANNEL_OPTIONS) for address in self.addresses
        ]
        try:
            replies = await asyncio.gather(*(
                worker_pb2_grpc.WorkerServiceStub(channel).GetWorkerInfo(
                    worker_pb2.GetWorkerInfoRequest(), timeout=self.connect_timeout_s,
                    metadata=self._metadata,
                )
                for channel in self._channels
            ))
        except grpc.aio.AioRpcError as exc:
            await self.close()
            raise WorkerFault(f"a worker did not answer: {exc.code().name} {exc.details()}") from exc
        infos = list(replies)
        problem = self._check_group(infos)
        if problem:
            await self.close()
            raise WorkerFault(problem)
        for channel in self._channels:
            call = worker_pb2_grpc.WorkerServiceStub(channel).Execute(metadata=self._metadata)
            call.add_done_callback(self._stream_ended)
            self._calls.append(call)
        return infos

    def _stream_ended(self, call: grpc.aio.StreamStreamCall) -> None:
        # Only a stream of the current connection breaks it: one that `close` cancelled may
        # report its end after the next `connect` began.
        if call in self._calls:
            self.broken.set()

    def _check_group(self, infos: list[worker_pb2.GetWorkerInfoResponse]) -> str | None:
        """Why these ranks do not form one TP group, or None when they do."""
        for rank, (address, info) in enumerate(zip(self.addresses, infos)):
            if info.rank != rank or info.world_size != len(infos):
                return (
                    f"worker {address} reports rank {info.rank} of {info.world_size}, "
                    f"expected {rank} of {len(infos)}"
                )
            if info.page_size != infos[0].page_size:
                return f"worker {address} has page size {info.page_size}, rank 0 {infos[0].page_size}"
            if info.num_pages < 1:
                return f"worker {address} has no KV pages"
        return None

    async def execute(self, task: worker_pb2.DecodeTask, timeout_s: float) -> worker_pb2.TaskResult:
        """Send `task` and wait for it (see `send` and `receive`)."""
        await self.send(task, timeout_s)
        return await self.receive(task, timeout_s)

    async def send(self, task: worker_pb2.DecodeTask, timeout_s: float) -> None:
        """Write `task` to every rank without waiting for its result; a rank runs the tasks it
        receives in order, so the next one can be sent while this one runs (overlap
        scheduling). Raises `WorkerFault`."""
        if not self._calls:
            raise WorkerFault("not connected")
        with self._faults(task, timeout_s):
            async with asyncio.timeout(timeout_s):
                await _each(call.write(task) for call in self._calls)

    async def receive(self, task: worker_pb2.DecodeTask, timeout_s: float) -> worker_pb2.TaskResult:
        """Wait at most `timeout_s` for every rank's answer to `task`, the oldest one sent and
        not yet received; returns rank 0's, with `idle_before_s` the largest over the ranks.
        Raises `TaskRejected` when every rank refused it, `WorkerFault` otherwise."""
        if not self._calls:
            raise WorkerFault("not connected")
        with self._faults(task, timeout_s):
            async with asyncio.timeout(timeout_s):
                results = await _each(call.read() for call in self._calls)
        errors = []
        for address, result in zip(self.addresses, results):
            if result is grpc.aio.EOF:
                raise WorkerFault(f"worker {address} closed its stream")
            if result.task_id != task.task_id:
                raise WorkerFault(f"worker {address} answered task {result.task_id}, not {task.task_id}")
            if result.HasField("error"):
                errors.append(f"worker {address}: code {result.error.code} {result.error.message}")
        if errors and len(errors) == len(results):
            raise TaskRejected(f"task {task.task_id} rejected: {'; '.join(errors)}")
        if errors:  # some ranks applied it, others did not: they no longer agree
            raise WorkerFault(f"ranks disagree on task {task.task_id}: {'; '.join(errors)}")
        first = results[0]
        first.idle_before_s = max(result.idle_before_s for result in results)
        return first

    @contextlib.contextmanager
    def _faults(self, task: worker_pb2.DecodeTask, timeout_s: float) -> Iterator[None]:
        """Turn a lost stream or a missed deadline into `WorkerFault`."""
        try:
            yield
        except TimeoutError as exc:
            raise WorkerFault(
                f"a worker did not answer task {task.task_id} within {timeout_s:g}s"
            ) from exc
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, ConnectionError) as exc:
            raise WorkerFault(f"worker stream failed: {exc}") from exc

    async def close(self) -> None:
        calls, channels = self._calls, self._channels
        self._calls, self._channels = [], []
        for call in calls:
            call.cancel()
        for channel in channels:
            await channel.close()


async def _each(calls: Iterable[Awaitable[T]]) -> list[T]:
    """The results of `calls`, awaited together. One rank's (TP=1) is awaited in place: gather
    would wrap it in a task of its own, one more turn of the event loop on the path between two
    steps."""
    calls = list(calls)
    if len(calls) == 1:
        return [await calls[0]]
    return list(await asyncio.gather(*calls))
