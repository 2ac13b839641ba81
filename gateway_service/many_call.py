"""One GenerateMany call: many requests on one gRPC stream, their output many tokens a message.

A Generate call costs the gateway one gRPC message per chunk, and on this machine grpc.aio
spends ~80 us of CPU on a message before the gateway does anything (`bench.grpc_floor`); that
floor is per message, not per token. Here a caller opens one call and starts requests on it,
each with an id of its own; each request runs as a Generate would (the servicer's `generate`:
the same validation, routing, assembly, metrics and drain), in a task of its own, and puts its
chunks in the call's outbox. The call writes whatever the outbox holds as one `ManyResponse`,
so the chunks of every request that a router step advanced go out together, and a request
whose caller reads slowly has its chunks wait and leave together.

Per request: a failure ends that request alone, with an update carrying the status its Generate
call would have ended with; `cancel` ends it with CANCELLED. The call itself fails only on what
is the call's own fault (an id started twice while open, a message that neither starts nor
cancels): INVALID_ARGUMENT, and every open request is cancelled. The call ends OK once the caller
has half-closed and every request has had its last update; a draining gateway refuses new
requests (UNAVAILABLE, per request) and ends the call with UNAVAILABLE once nothing is open.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable

import grpc

from gateway_service.caller import Caller, request_id_from
from gateway_service.errors import InvalidRequest, ShuttingDown, to_status
from gateway_service.known_fields import check_known_fields
from gateway_service.mailbox import Mailbox
from gateway_service.plain_lane import Sink
from radixserve.v1 import generation_pb2

# A response message holds at most this many updates, and stops growing past this many bytes
# (the chunks' serialized sizes), so one message stays well under any receive limit.
MAX_UPDATES_PER_MESSAGE = 512
MAX_MESSAGE_BYTES = 1 << 20
# Updates waiting for the writer past which the call stops reading new requests until the writer
# takes them: a caller that sends without reading (or reads slowly) holds its own requests back
# (gRPC's flow control), instead of piling refusals and cancellations up in the gateway.
MAX_WAITING_UPDATES = 4096
_CANCELLED = (grpc.StatusCode.CANCELLED, "cancelled by the caller")

# An outbox item: (id, chunk, None) for output, (id, None, (code, message)) for a failure, or
# None to wake the writer (the caller half-closed, the gateway began to drain).
Item = tuple[int, generation_pb2.GenerateResponse | None, tuple[grpc.StatusCode, str] | None] | None

# generate(request, caller, sink) -> the request's chunks, as the servicer's `generate` streams
# them; it may also hand chunks to `sink` directly, in order with the stream's (plain_lane.py).
Generate = Callable[[generation_pb2.GenerateRequest, Caller, Sink], AsyncIterator[generation_pb2.GenerateResponse]]


class ManyCall:
    """Made in the handler's task; `responses` is the handler's output."""

    def __init__(self, generate: Generate, caller_of: Callable[[generation_pb2.GenerateRequest, int], Caller],
                 max_open: int, draining: Callable[[], bool]) -> None:
        self._generate = generate
        self._caller_of = caller_of
        self._max_open = max_open
        self._draining = draining
        self._open: dict[int, asyncio.Task] = {}
        self._outbox: Mailbox[Item] = Mailbox()
        self._room = asyncio.Event()  # set while the outbox has room (see MAX_WAITING_UPDATES)
        self._room.set()

    def wake(self) -> None:
        """Have the writer look at the call's state again (the gateway began to drain)."""
        self._outbox.put(None)

    async def responses(self, requests: AsyncIterator[generation_pb2.ManyRequest]) -> AsyncIterator[
            generation_pb2.ManyResponse]:
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                items = await self._outbox.take()
                # The tasks woken with these items run first: a router message's plain tokens
                # came by their lanes and woke this writer before the tasks of its updates (a
                # request's first and last tokens) ran; theirs join this message, not one of
                # their own.
                await asyncio.sleep(0)
                items += self._outbox.take_nowait()
                self._room.set()
                for message in _messages(items):
                    yield message
                if reader.done() and reader.exception() is not None:
                    raise reader.exception()
                if not self._open and (reader.done() or self._draining()):
                    # What came in while the last messages were written: the last updates.
                    for message in _messages(self._outbox.take_nowait()):
                        yield message
                    if reader.done():
                        return
                    raise ShuttingDown("the gateway is shutting down; retry on another replica")
        finally:
            reader.cancel()
            for task in list(self._open.values()):
                task.cancel()
            # The tasks end at their next await; their updates have nowhere to go.
            await asyncio.gather(reader, *self._open.values(), return_exceptions=True)

    async def _read(self, requests: AsyncIterator[generation_pb2.ManyRequest]) -> None:
        try:
            async for message in requests:
                if len(self._outbox) >= MAX_WAITING_UPDATES:
                    self._room.clear()
                    await self._room.wait()
                check_known_fields(message, nested=False)  # its request is checked when it starts
                action = message.WhichOneof("action")
                if action == "generate":
                    self._start(message.id, message.generate)
                elif action == "cancel":
                    task = self._open.get(message.id)
                    if task is not None:
                        task.cancel()
                else:
                    raise InvalidRequest(f"request {message.id}: a ManyRequest must set generate or cancel")
        finally:
            self._outbox.put(None)

    def _start(self, request_id: int, request: generation_pb2.GenerateRequest) -> None:
        if request_id in self._open:
            raise InvalidRequest(f"request {request_id} is already open on this call (ids must be unique among "
                                 "the call's open requests)")
        if len(self._open) >= self._max_open:
            self._outbox.put((request_id, None, (
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this call already has {self._max_open} open requests (the gateway's --max-requests-per-call)")))
            return
        task = asyncio.create_task(self._run(request_id, request))
        # The bookkeeping runs when the task ends, not in its body: a task cancelled before its
        # first step (a cancel read right after its start) never runs its body at all.
        task.add_done_callback(functools.partial(self._ended, request_id))
        self._open[request_id] = task

    async def _run(self, request_id: int, request: generation_pb2.GenerateRequest) -> None:
        put = self._outbox.put

        def sink(chunk: generation_pb2.GenerateResponse) -> None:
            put((request_id, chunk, None))

        try:
            caller = self._caller_of(request, request_id)
            async with contextlib.aclosing(self._generate(request, caller, sink)) as chunks:
                async for chunk in chunks:
                    put((request_id, chunk, None))
        except asyncio.CancelledError:
            # The caller's cancel (or the call's end, when nothing reads the outbox any more).
            put((request_id, None, _CANCELLED))
        except Exception as exc:
            put((request_id, None, to_status(exc)))

    def _ended(self, request_id: int, task: asyncio.Task) -> None:
        if task.cancelled():  # cancelled before its body ran: its last update is said here
            self._outbox.put((request_id, None, _CANCELLED))
        if self._open.get(request_id) is task:
            del self._open[request_id]
        self._outbox.put(None)  # the writer looks again: this may have been the last open request


def request_caller(call: Caller, request: generation_pb2.GenerateRequest, request_id: int, max_len: int) -> Caller:
    """A request's caller: the call's, with the request's own `request_id`, else the call's id
    and the request's (`request_id_from`: a new id where that is not usable)."""
    presented = request.request_id or f"{call.request_id}-{request_id}"
    return Caller(request_id_from(presented, max_len), call.user, call.client)


def _messages(items: list[Item]) -> list[generation_pb2.ManyResponse]:
    """The outbox's items as response messages, in order (none when there is only wake-ups)."""
    messages: list[generation_pb2.ManyResponse] = []
    updates = None
    count = size = 0
    for item in items:
        if item is None:
            continue
        if updates is None or count >= MAX_UPDATES_PER_MESSAGE or size >= MAX_MESSAGE_BYTES:
            message = generation_pb2.ManyResponse()
            messages.append(message)
            updates, count, size = message.updates, 0, 0
        request_id, chunk, error = item
        update = updates.add()
        update.id = request_id
        if chunk is not None:
            update.response.CopyFrom(chunk)
            size += chunk.ByteSize()
        else:
            code, text = error
            update.code = code.value[0]
            update.message = text
            size += len(text)
        count += 1
    return messages

