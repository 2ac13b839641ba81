"""Concurrent requests of one `AsyncClient` carried on shared GenerateMany calls
(`AsyncClient(..., multiplex=True)`).

A Generate call per request costs a gRPC message per chunk on both ends; on one GenerateMany
call the gateway puts every chunk its requests made since its last write into one message
(docs/api.md, "Many requests on one call"). Here each `stream` opens its request on a call that
has room (at most `window` open requests a call; a new call when all are full), reads its own
updates as a Generate stream's responses, and on leaving early (a break, a cancelled task, its
timeout) sends the call a cancel for it. A request that fails on the gateway raises its typed
error, as its Generate call would; a call that ends (the gateway went away) fails the requests
open on it with the call's status, and the next request opens a new call. A call with no
request left open is ended, so an idle client holds none.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import grpc

from radixserve_client.errors import (
    CancelledError, DeadlineExceededError, RadixServeError, UnavailableError, from_rpc_error, from_status,
)
from radixserve.v1 import generation_pb2, generation_pb2_grpc

_Item = generation_pb2.ManyUpdate | RadixServeError


class _Call:
    """One GenerateMany call: what to send on it, and the inbox of each request open on it."""

    def __init__(self, stub: generation_pb2_grpc.GenerationServiceStub, metadata) -> None:
        self.outgoing: asyncio.Queue[generation_pb2.ManyRequest | None] = asyncio.Queue()
        self.inboxes: dict[int, asyncio.Queue[_Item]] = {}
        self.ended = False  # nothing more may open on it
        self._call = stub.GenerateMany(self._messages(), metadata=metadata)
        self.reader = asyncio.ensure_future(self._read())

    async def _messages(self) -> AsyncIterator[generation_pb2.ManyRequest]:
        while (message := await self.outgoing.get()) is not None:
            yield message

    async def _read(self) -> None:
        try:
            async for reply in self._call:
                for update in reply.updates:
                    inbox = self.inboxes.get(update.id)
                    if inbox is not None:  # else: left by its caller, its cancel on the way
                        inbox.put_nowait(update)
            error: RadixServeError = UnavailableError("the gateway ended the GenerateMany call")
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc)
        except asyncio.CancelledError:
            error = CancelledError("the client was closed")
        except Exception as exc:  # a fault of ours: fail the requests rather than leave them waiting
            error = RadixServeError(f"reading the GenerateMany call failed: {exc!r}")
        self.ended = True
        for inbox in self.inboxes.values():
            inbox.put_nowait(error)

    def end(self) -> None:
        """Nothing more opens here: the call ends once the gateway has seen the last cancel."""
        if not self.ended:
            self.ended = True
            self.outgoing.put_nowait(None)

    def cancel(self) -> None:
        self.ended = True
        self._call.cancel()


class SharedCalls:
    """The GenerateMany calls one client's concurrent requests share."""

    def __init__(self, stub: generation_pb2_grpc.GenerationServiceStub, metadata, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self._stub = stub
        self._metadata = metadata
        self._window = window
        self._calls: list[_Call] = []  # every call not yet over, ending ones too
        self._ids = itertools.count()

    def _call_with_room(self) -> _Call:
        for call in self._calls:
            if not call.ended and len(call.inboxes) < self._window:
                return call
        call = _Call(self._stub, self._metadata)
        self._calls.append(call)
        call.reader.add_done_callback(lambda _, call=call: self._calls.remove(call))
        return call

    async def stream(self, request: generation_pb2.GenerateRequest,
                     timeout: float | None) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The request's responses, as its Generate call would stream them; raises its typed
        error as that call would (`timeout`: seconds for the whole request, as Generate's)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        call = self._call_with_room()
        request_id = next(self._ids)
        inbox: asyncio.Queue[_Item] = asyncio.Queue()
        call.inboxes[request_id] = inbox
        call.outgoing.put_nowait(generation_pb2.ManyRequest(id=request_id, generate=request))
        ended = False
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        item = await inbox.get()
                except TimeoutError:
                    raise DeadlineExceededError("Deadline Exceeded") from None
                if isinstance(item, RadixServeError):  # the call's failure, one for all its requests
                    ended = True
                    raise type(item)(item.message, item.code)
                if item.code:
                    ended = True
                    raise from_status(item.code, item.message)
                ended = item.response.finish_reason != 0
                yield item.response
                if ended:
                    return
        finally:
            del call.inboxes[request_id]
            if not call.ended:
                if not ended:
                    call.outgoing.put_nowait(generation_pb2.ManyRequest(id=request_id, cancel=True))
                if not call.inboxes:
                    call.end()

    async def close(self) -> None:
        calls = list(self._calls)
        for call in calls:
            call.cancel()
        await asyncio.gather(*(call.reader for call in calls))
