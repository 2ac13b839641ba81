"""Concurrent requests of one client carried on shared GenerateMany calls
(`AsyncClient(..., multiplex=True)`, `Client(..., multiplex=True)`).

A Generate call per request costs a gRPC message per chunk on both ends; on one GenerateMany
call the gateway puts every chunk its requests made since its last write into one message
(docs/api.md, "Many requests on one call"). Here each `stream` opens its request on a call that
has room (at most `window` open requests a call; a new call when all are full), reads its own
updates as a Generate stream's responses, and on leaving early (a break, a cancelled task, its
timeout) sends the call a cancel for it. A request that fails on the gateway raises its typed
error, as its Generate call would; a call that ends (the gateway went away) fails the requests
open on it with the call's status, and the next request opens a new call. A call with no
request left open is ended, so an idle client holds none.

`CallState` is that bookkeeping, whatever runs it; `SharedCalls` runs it on asyncio (a reader
task per call), shared_call_threads.py on threads (a reader thread per call).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterable
from typing import Protocol

import grpc

from radixserve_client.errors import (
    CancelledError, DeadlineExceededError, RadixServeError, UnavailableError, from_rpc_error, from_status,
)
from radixserve_client.many import DEFAULT_WINDOW
from radixserve.v1 import generation_pb2, generation_pb2_grpc

Item = generation_pb2.ManyUpdate | RadixServeError  # what a request's inbox holds


class Box(Protocol):
    """An inbox or outbox: `asyncio.Queue` or `queue.SimpleQueue`."""

    def put_nowait(self, item, /) -> None: ...


def check_window(multiplex: bool, window: int | None) -> int:
    """The requests one shared call may have open (a client's `window` argument)."""
    if window is not None and not multiplex:
        raise ValueError("window is the requests open on one shared call: it goes with multiplex=True")
    if window is None:
        return DEFAULT_WINDOW
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    return window


def response_of(item: Item) -> generation_pb2.GenerateResponse:
    """The response an inbox item carries; raises the request's typed error where it failed
    (a fresh one for each request of a failed call: one exception object raised in several
    places would share its traceback)."""
    if isinstance(item, RadixServeError):
        raise type(item)(item.message, item.code)
    if item.code:
        raise from_status(item.code, item.message)
    return item.response


def call_error(exc: BaseException | None, closing: bool) -> RadixServeError:
    """Why a call's requests fail when its reading ends: `exc` what ended it (None: the gateway
    ended the call), `closing` whether the client is being closed."""
    if closing:
        return CancelledError("the client was closed")
    if exc is None:
        return UnavailableError("the gateway ended the GenerateMany call")
    if isinstance(exc, grpc.RpcError):
        return from_rpc_error(exc)
    return RadixServeError(f"reading the GenerateMany call failed: {exc!r}")  # a fault of ours


class CallState:
    """One shared call's bookkeeping: what to send on it (`outgoing`, None ends the caller's
    stream) and the inbox of each request open on it. Run by one thread of control at a time
    (the event loop, or under the threaded client's lock)."""

    def __init__(self, outgoing: Box) -> None:
        self.outgoing = outgoing
        self.inboxes: dict[int, Box] = {}
        self.ended = False  # nothing more may open on it
        self.closing = False  # the client is being closed

    def open(self, request_id: int, inbox: Box, request: generation_pb2.GenerateRequest) -> None:
        self.inboxes[request_id] = inbox
        self.outgoing.put_nowait(generation_pb2.ManyRequest(id=request_id, generate=request))

    def deliver(self, updates: Iterable[generation_pb2.ManyUpdate]) -> None:
        for update in updates:
            inbox = self.inboxes.get(update.id)
            if inbox is not None:  # else: left by its caller, its cancel on the way
                inbox.put_nowait(update)

    def leave(self, request_id: int, ended: bool) -> None:
        """Request `request_id`'s caller is done with it (`ended`: it had its last update): a
        cancel for it if not, and the end of the call if nothing is left open on it."""
        del self.inboxes[request_id]
        if self.ended:
            return
        if not ended:
            self.outgoing.put_nowait(generation_pb2.ManyRequest(id=request_id, cancel=True))
        if not self.inboxes:
            self.end()

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.outgoing.put_nowait(None)

    def fail(self, error: RadixServeError) -> None:
        """The call is over: every request still open on it fails with `error`."""
        self.end()
        for inbox in self.inboxes.values():
            inbox.put_nowait(error)


class CallPool:
    """The shared calls of one client: a request opens on the first call with room, or on a
    new one (`new_call`) when none has. A call is kept until it is `over` (its reader done),
    ended ones too: they still hold a reader, which `close` stops."""

    def __init__(self, stub: generation_pb2_grpc.GenerationServiceStub, metadata, window: int) -> None:
        self._stub = stub
        self._metadata = metadata
        self._window = window
        self._calls: list = []  # of the subclass's calls, until they are over
        self._ids = itertools.count()

    def new_call(self):
        raise NotImplementedError

    @staticmethod
    def over(call) -> bool:
        raise NotImplementedError

    def open(self, request: generation_pb2.GenerateRequest, inbox: Box):
        """Open `request` on a call with room; returns the call and the request's id there."""
        self._calls = [call for call in self._calls if not self.over(call)]
        call = next((call for call in self._calls if not call.ended and len(call.inboxes) < self._window), None)
        if call is None:
            call = self.new_call()
            self._calls.append(call)
        request_id = next(self._ids)
        call.open(request_id, inbox, request)
        return call, request_id


class _Call(CallState):
    """A call run by a reader task."""

    def __init__(self, stub: generation_pb2_grpc.GenerationServiceStub, metadata) -> None:
        super().__init__(asyncio.Queue())
        self._call = stub.GenerateMany(self._messages(), metadata=metadata)
        self.reader = asyncio.ensure_future(self._read())

    async def _messages(self) -> AsyncIterator[generation_pb2.ManyRequest]:
        while (message := await self.outgoing.get()) is not None:
            yield message

    async def _read(self) -> None:
        ended_by: BaseException | None = None
        try:
            async for reply in self._call:
                self.deliver(reply.updates)
        except (Exception, asyncio.CancelledError) as exc:
            ended_by = exc
        self.fail(call_error(ended_by, self.closing))

    def cancel(self) -> None:
        self.closing = True
        self._call.cancel()


class SharedCalls(CallPool):
    """The GenerateMany calls one asyncio client's concurrent requests share."""

    def new_call(self) -> _Call:
        return _Call(self._stub, self._metadata)

    @staticmethod
    def over(call: _Call) -> bool:
        return call.reader.done()

    async def stream(self, request: generation_pb2.GenerateRequest,
                     timeout: float | None) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The request's responses, as its Generate call would stream them; raises its typed
        error as that call would (`timeout`: seconds for the whole request, as Generate's)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        inbox: asyncio.Queue[Item] = asyncio.Queue()
        call, request_id = self.open(request, inbox)
        ended = False
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        item = await inbox.get()
                except TimeoutError:
                    raise DeadlineExceededError("Deadline Exceeded") from None
                ended = True  # if response_of raises: the request failed, nothing to cancel
                response = response_of(item)
                ended = response.finish_reason != 0
                yield response
                if ended:
                    return
        finally:
            call.leave(request_id, ended)

    async def close(self) -> None:
        calls, self._calls = self._calls, []
        for call in calls:
            call.cancel()
        await asyncio.gather(*(call.reader for call in calls))
