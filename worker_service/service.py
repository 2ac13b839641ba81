"""The WorkerService gRPC servicer: GetWorkerInfo and the ordered Execute stream.

Tasks run on one dedicated thread, strictly in arrival order (also across streams), so that the
event loop stays free to answer health checks and GetWorkerInfo during a forward pass, and so that
every rank applies the same tasks in the same order. A task is handed to that thread as soon as
it arrives, so one that the router sent ahead (overlap scheduling) starts the moment the one
before it ends; its entries may refer to tokens the one before sampled (`sampled_tokens`).
Each result says how long the thread idled before its task.

Results go back to the event loop through a small notifier thread, not from the task thread
itself: waking the loop there would hand it the GIL at the very moment the next task should
start, and the task thread would wait for the loop's burst of work (sending the result,
reading the next message) before starting it. This way the next task is under way first, and
the loop's work runs while the forward pass is in torch (which releases the GIL).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from radixserve.v1 import worker_pb2, worker_pb2_grpc
from worker_service.distributed import TPGroup
from worker_service.executor import INTERNAL, INVALID_ARGUMENT, Executor
from worker_service.sampled_tokens import BadReference, SampledTokens

log = logging.getLogger(__name__)

T = TypeVar("T")

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
# Tasks of one stream taken in before their results are sent: the router keeps at most two
# outstanding (one step ahead); beyond these, gRPC flow control holds the caller back.
MAX_TASKS_AHEAD = 2


class WorkerService(worker_pb2_grpc.WorkerServiceServicer):
    """Serves one rank. Registered before the model loads; answers UNAVAILABLE until `attach`."""

    def __init__(self, on_broken: Callable[[str], None] | None = None) -> None:
        """`on_broken(reason)` is called when a task fails in the forward pass (not for a task
        rejected as malformed); None: report it to the router and go on."""
        self._on_broken = on_broken
        self._executor: Executor | None = None
        self._sampled: SampledTokens | None = None
        self._last_finished: float | None = None  # when the task thread last finished a task
        # One thread: tasks must never overlap, and their order is the protocol. It is also the
        # only thread that runs torch (the model loads on it too, see `run_on_task_thread`).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="execute")
        self._finished: queue.SimpleQueue[_Finished | None] = queue.SimpleQueue()
        self._notifier = threading.Thread(target=self._notify, name="execute-notify", daemon=True)
        self._notifier.start()

    async def run_on_task_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the task thread, e.g. loading the model before any task.

        Every thread that opens OpenMP parallel regions gets its own team of OpenMP threads. Two
        teams (one from loading, one from tasks) outnumber a small machine's cores, and libgomp
        then stops spin-waiting between regions: each of a step's hundreds of parallel regions
        pays a futex wake-up, which slows every small kernel several times (figures in
        docs/worker-backends.md).
        """
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def attach(self, executor: Executor) -> None:
        """Start serving with a loaded model (weights in place, TP group formed)."""
        self._sampled = SampledTokens(TPGroup(executor.info.rank, executor.info.world_size), executor.info.device)
        self._executor = executor

    def close(self) -> None:
        """Let the task thread go; a task already running finishes first."""
        self._thread.shutdown(wait=True)
        self._finished.put(None)
        self._notifier.join()

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
        # Results to send, in task order; None after the last.
        running: asyncio.Queue[asyncio.Future[worker_pb2.TaskResult] | None] = asyncio.Queue()
        ahead = asyncio.Semaphore(MAX_TASKS_AHEAD)

        async def read() -> None:
            try:
                async for message in request_iterator:
                    await ahead.acquire()
                    # To the task thread at once: it starts the moment the task before ends.
                    future = loop.create_future()
                    self._thread.submit(self._run_and_post, executor, message, _Finished(loop, future))
                    running.put_nowait(future)
            except Exception:  # the stream broke: answer what was started, then end
                log.exception("Execute stream from %s failed", peer)
            finally:
                running.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (future := await running.get()) is not None:
                # If the caller goes away mid-task the task still completes on its thread: a
                # task is applied whole or not at all, never half.
                result = await future
                ahead.release()
                if result.HasField("error") and result.error.code != INVALID_ARGUMENT and self._on_broken:
                    self._on_broken(f"task {result.task_id} failed: {result.error.message}")
                num_tasks += 1
                yield result
        finally:
            reader.cancel()
            log.info("Execute stream from %s ended after %d tasks", peer, num_tasks)

    def _run_and_post(self, executor: Executor, message: worker_pb2.DecodeTask, finished: "_Finished") -> None:
        try:
            finished.result = self._run(executor, message)
        except BaseException as exc:  # handed to the stream, which fails with it
            finished.error = exc
        self._finished.put(finished)

    def _notify(self) -> None:
        """The notifier thread: hands finished tasks' results to their event loops."""
        while (finished := self._finished.get()) is not None:
            try:
                finished.loop.call_soon_threadsafe(finished.settle)
            except RuntimeError:  # the loop is closed: nobody waits for it any more
                pass

    def _run(self, executor: Executor, message: worker_pb2.DecodeTask) -> worker_pb2.TaskResult:
        """One task on the task thread: resolve its references to sampled tokens, execute."""
        started = time.monotonic()
        idle_s = 0.0 if self._last_finished is None else started - self._last_finished
        sampled = self._sampled
        assert sampled is not None  # set with the executor
        try:
            sampled.resolve(message)
        except BadReference as exc:
            log.warning("task %d rejected: %s", message.task_id, exc)
            result = _error_result(message, executor, INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # the broadcast failed: the group is broken
            log.exception("task %d: sampled tokens not resolved", message.task_id)
            result = _error_result(message, executor, INTERNAL, f"broadcast failed: {exc}")
        else:
            result = executor.execute(message)
            sampled.record(message, result)
        result.idle_before_s = idle_s
        if executor.metrics is not None:
            executor.metrics.idle_done(idle_s)
        self._last_finished = time.monotonic()
        return result


def _error_result(
    message: worker_pb2.DecodeTask, executor: Executor, code: int, text: str
) -> worker_pb2.TaskResult:
    return worker_pb2.TaskResult(
        task_id=message.task_id, rank=executor.info.rank,
        error=worker_pb2.TaskError(code=code, message=text),
    )


class _Finished:
    """A task's outcome on its way from the task thread to the event loop that waits for it."""

    __slots__ = ("loop", "future", "result", "error")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[worker_pb2.TaskResult]) -> None:
        self.loop = loop
        self.future = future
        self.result: worker_pb2.TaskResult | None = None
        self.error: BaseException | None = None

    def settle(self) -> None:
        """On the loop: complete the future (unless its stream went away)."""
        if self.future.done():
            return
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(self.result)
