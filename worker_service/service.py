"""The WorkerService gRPC servicer: GetWorkerInfo and the ordered Execute stream.

Tasks run on one dedicated thread, strictly in arrival order (also across streams), so that the
event loop stays free to answer health checks and GetWorkerInfo during a forward pass, and so that
every rank applies the same tasks in the same order. The executor takes and returns the wire
messages themselves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from radixserve.v1 import worker_pb2, worker_pb2_grpc
from worker_service.executor import INVALID_ARGUMENT, Executor

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name


class WorkerService(worker_pb2_grpc.WorkerServiceServicer):
    """Serves one rank. Registered before the model loads; answers UNAVAILABLE until `attach`."""

    def __init__(self, on_broken: Callable[[str], None] | None = None) -> None:
        """`on_broken(reason)` is called when a task fails in the forward pass (not for a task
        rejected as malformed); None: report it to the router and go on."""
        self._on_broken = on_broken
        self._executor: Executor | None = None
        # One thread: tasks must never overlap, and their order is the protocol.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="execute")

    def attach(self, executor: Executor) -> None:
        """Start serving with a loaded model (weights in place, TP group formed)."""
        self._executor = executor

    def close(self) -> None:
        """Let the task thread go; a task already running finishes first."""
        self._thread.shutdown(wait=True)

    async def _ready(self, context: grpc.aio.ServicerContext) -> Executor:
        if self._executor is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is still loading its model")
        return self._executor

    async def GetWorkerInfo(
        self, request: worker_pb2.GetWorkerInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetWorkerInfoResponse:
        executor = await self._ready(context)
        return executor.info

    async def Execute(
        self, request_iterator: AsyncIterator[worker_pb2.DecodeTask], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.TaskResult]:
        executor = await self._ready(context)
        loop = asyncio.get_running_loop()
        peer, num_tasks = context.peer(), 0
        log.info("Execute stream opened by %s", peer)
        try:
            async for message in request_iterator:
                # If the caller goes away mid-task the task still completes on its thread: a task
                # is applied whole or not at all, never half.
                result = await loop.run_in_executor(self._thread, executor.execute, message)
                if result.HasField("error") and result.error.code != INVALID_ARGUMENT and self._on_broken:
                    self._on_broken(f"task {message.task_id} failed: {result.error.message}")
                num_tasks += 1
                yield result
        finally:
            log.info("Execute stream from %s ended after %d tasks", peer, num_tasks)
