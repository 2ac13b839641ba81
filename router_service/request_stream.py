"""One caller's multiplexed call (`RouterService.Stream`): many requests, one message per step.

Generate answers each request on its own call, a gRPC message per request per step: at 32
running requests that is 32 messages a step on each side, and every message costs CPU in grpc's
asyncio layer that a machine short of cores takes from the forward pass (the figures are in
docs/router-core.md).
On a Stream call the caller opens and cancels requests, and the engine's events for all of them
go back together: the engine hands a step's events over in one go (`Engine._flush`), and the
call writes whatever has gathered since its last message as one message.
Every message carries the router's load (`RouterLoad`); while no request produces one, a message
with the load alone goes out every `load_report_interval_s` when the load changed, so the
gateways holding these calls route by current figures without asking.

A request on the call behaves as on Generate: the same checks, the same events, the same
statuses (as an error update); it is cancelled when the caller says so or when the call ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from radixserve.v1 import router_pb2
from router_service import convert
from router_service.core.request import Request
from router_service.engine import Engine, StreamEvent
from router_service.errors import InvalidRequest, RouterError

log = logging.getLogger(__name__)


class RequestStream:
    """The requests open on one Stream call and the updates not yet written to it."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._open: dict[str, Request] = {}  # by the caller's request id
        # The next message, its updates written in place as events come (no copy when sent).
        self._pending = router_pb2.RouterStreamResponse()
        self._ready = asyncio.Event()
        self._caller_done = False
        self._report_due = True  # the first message: the load, before any request opens
        self._last_load: router_pb2.RouterLoad | None = None
        self._report_timer: asyncio.TimerHandle | None = None

    def open(self, message: router_pb2.RouterGenerateRequest) -> None:
        """Submit a request; a refusal becomes its (only) update."""
        caller_id = message.request_id
        try:
            if not caller_id:
                raise InvalidRequest("request_id must be set on a Stream call")
            if caller_id in self._open:
                raise InvalidRequest(f"request_id {caller_id!r} is already open on this call")
            request = convert.request_from_proto(message, self._engine.config.max_request_id_bytes)
            self._engine.submit(request, _Sink(self, caller_id, request))
        except RouterError as exc:
            self._add_error(caller_id, exc)
            return
        except Exception:  # a router bug: this request fails, the call and its others go on
            log.exception("opening request %r on a Stream call failed", caller_id)
            self._add_error(caller_id, RouterError("internal error in the router"))
            return
        self._open[caller_id] = request

    def cancel(self, caller_id: str) -> None:
        request = self._open.pop(caller_id, None)
        if request is not None:
            self._engine.cancel(request)

    def caller_done(self) -> None:
        """The caller sent its last message: the call ends once its open requests have."""
        self._caller_done = True
        self._ready.set()

    def close(self) -> None:
        """The call ended: cancel what is still open."""
        if self._report_timer is not None:
            self._report_timer.cancel()
        for request in self._open.values():
            self._engine.cancel(request)
        self._open.clear()

    async def responses(self) -> AsyncIterator[router_pb2.RouterStreamResponse]:
        """Everything gathered since the last message, as one message, until the caller is done
        and nothing is open."""
        self._ready.set()
        while True:
            await self._ready.wait()
            self._ready.clear()
            has_updates = bool(self._pending.updates)
            if has_updates or self._report_due:
                load = self._engine.load()
                if has_updates or load != self._last_load:
                    self._last_load = load
                    message, self._pending = self._pending, router_pb2.RouterStreamResponse()
                    message.load.CopyFrom(load)
                    yield message
                if self._report_due:
                    self._report_due = False
                    self._report_timer = asyncio.get_running_loop().call_later(
                        self._engine.config.load_report_interval_s, self._report)
            if self._caller_done and not self._open and not self._pending.updates:
                return

    def _report(self) -> None:
        self._report_due = True
        self._ready.set()

    def event(self, caller_id: str, request: Request, event: StreamEvent) -> None:
        """One of the engine's events for an open request (see `_Sink`)."""
        if self._open.get(caller_id) is not request:
            return  # cancelled by the caller while the event waited in the engine's outbox
        if event.error is not None or event.finished:
            self._open.pop(caller_id, None)
        if event.error is not None:
            self._add_error(caller_id, event.error)
            return
        update = self._pending.updates.add(request_id=caller_id)
        convert.response_to_proto(event.token_ids, event.logprobs, request, event.finished, into=update.response)
        self._ready.set()

    def _add_error(self, caller_id: str, error: RouterError) -> None:
        code, message = convert.status_of(error)
        self._pending.updates.add(request_id=caller_id, error_code=code.value[0], error_message=message)
        self._ready.set()


class _Sink:
    """Where the engine puts one request's events (in place of Generate's queue)."""

    __slots__ = ("_stream", "_caller_id", "_request")

    def __init__(self, stream: RequestStream, caller_id: str, request: Request) -> None:
        self._stream = stream
        self._caller_id = caller_id
        self._request = request

    def put_nowait(self, event: StreamEvent) -> None:
        self._stream.event(self._caller_id, self._request, event)
