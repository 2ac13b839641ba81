"""Concurrent requests of one blocking `Client` carried on shared GenerateMany calls
(`Client(..., multiplex=True)`): shared_call.py's bookkeeping run on threads.

Each call has a reader thread that hands every update to its request's queue; a request's
thread waits on that queue (up to its timeout). One lock guards the bookkeeping of every call,
what is sent on a call included, so a request's cancel never follows the end of its call's
stream.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

from radixserve_client.errors import DeadlineExceededError
from radixserve_client.shared_call import CallPool, CallState, Item, call_error, response_of
from radixserve.v1 import generation_pb2, generation_pb2_grpc

# How long `close` waits for a call's reader to see the call cancelled.
CLOSE_JOIN_S = 5.0


class _Call(CallState):
    """A call run by a reader thread."""

    def __init__(self, stub: generation_pb2_grpc.GenerationServiceStub, metadata, lock: threading.Lock) -> None:
        outgoing: queue.SimpleQueue[generation_pb2.ManyRequest | None] = queue.SimpleQueue()
        super().__init__(outgoing)
        self._lock = lock
        self._call = stub.GenerateMany(iter(outgoing.get, None), metadata=metadata)
        self.reader = threading.Thread(target=self._read, name="radixserve-shared-call", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        ended_by: BaseException | None = None
        try:
            for reply in self._call:
                with self._lock:
                    self.deliver(reply.updates)
        except Exception as exc:
            ended_by = exc
        with self._lock:
            self.fail(call_error(ended_by, self.closing))  # its end also lets grpc's sending thread finish

    def cancel(self) -> None:
        self.closing = True
        self._call.cancel()


class ThreadSharedCalls(CallPool):
    """The GenerateMany calls one blocking client's concurrent requests share."""

    def __init__(self, stub: generation_pb2_grpc.GenerationServiceStub, metadata, window: int) -> None:
        super().__init__(stub, metadata, window)
        self._lock = threading.Lock()

    def new_call(self) -> _Call:
        return _Call(self._stub, self._metadata, self._lock)

    @staticmethod
    def over(call: _Call) -> bool:
        return not call.reader.is_alive()

    def stream(self, request: generation_pb2.GenerateRequest,
               timeout: float | None) -> Iterator[generation_pb2.GenerateResponse]:
        """As shared_call.SharedCalls.stream, blocking."""
        deadline = None if timeout is None else time.monotonic() + timeout
        inbox: queue.SimpleQueue[Item] = queue.SimpleQueue()
        with self._lock:
            call, request_id = self.open(request, inbox)
        ended = False
        try:
            while True:
                try:
                    if deadline is None:
                        item = inbox.get()
                    else:
                        item = inbox.get(timeout=max(deadline - time.monotonic(), 0.0))
                except queue.Empty:
                    raise DeadlineExceededError("Deadline Exceeded") from None
                ended = True  # if response_of raises: the request failed, nothing to cancel
                response = response_of(item)
                ended = response.finish_reason != 0
                yield response
                if ended:
                    return
        finally:
            with self._lock:
                call.leave(request_id, ended)

    def close(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for call in calls:
            call.cancel()
        for call in calls:
            call.reader.join(CLOSE_JOIN_S)
