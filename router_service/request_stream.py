"""One caller's multiplexed call (`RouterService.Stream`): many requests, one message per step.

Generate answers each request on its own call, a gRPC message per request per step: at 32
running requests that is 32 messages a step on each side, and every message costs CPU in grpc's
asyncio layer that a machine short of cores takes from the forward pass (the figures are in
docs/router-core.md).
On a Stream call the caller opens and cancels requests, and the engine's events for all of them
go back together: the engine hands a step's events over in one go (`Engine._flush`), and the
call writes whatever has gathered since its last message as one message.
A caller that says it reads them (radixserve/bare_tokens.py's call metadata, as the gateway does)
gets a request's "bare" tokens, one token with nothing else new (no logprobs, not its last, the
usage of its update before plus that token), as two packed columns of the message
(`bare_request_ids`, `bare_token_ids`) instead of an update each: building and reading an update
costs about a microsecond a token on each side, the columns a few for the whole message. A
request's first update, its last, and any that says more are updates; the caller applies a
message's bare tokens before its updates, so a request with an update in a message gets no bare
token after it in that message.
Every message carries the router's load (`RouterLoad`); while no request produces one, a message
with the load alone goes out every `load_report_interval_s` when the load changed, so the
gateways holding these calls route by current figures without asking.

A request on the call behaves as on Generate: the same checks, the same events, the same
statuses (as an error update); it is cancelled when the caller says so or when the call ends.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable

from radixserve.v1 import router_pb2
from router_service import convert
from router_service.core.request import Request
from router_service.engine import Engine
from router_service.events import StreamEvent
from router_service.errors import InvalidRequest, RouterError

log = logging.getLogger(__name__)

# An update not yet built: the caller's request id, the request (None for a refusal), the event,
# and the request's `usage_counts` when the event came (None with an error).
_Pending = tuple[str, Request | None, StreamEvent, convert.UsageCounts | None]


class RequestStream:
    """The requests open on one Stream call and the updates not yet written to it."""

    def __init__(self, engine: Engine, bare_tokens: bool = False) -> None:
        """`bare_tokens`: the caller reads bare tokens (see the module's docstring)."""
        self._engine = engine
        self._bare_tokens = bare_tokens
        self._open: dict[str, Request] = {}  # by the caller's request id
        # The next message's updates, in order, as the events came: built into the message when
        # it is written (`_message`), so that handing a step's events over costs the engine
        # little (it does so before it awaits its task's send). An update of tokens carries the
        # request's `usage_counts` as they were then; a refusal or failure, the error.
        self._pending: list[_Pending] = []
        # The next message's bare tokens, and the requests that have an update in it.
        self._bare_ids: list[str] = []
        self._bare_token_ids: list[int] = []
        self._updated: set[str] = set()
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
            self._engine.submit(request, _Sink(self, caller_id, request, self._bare_tokens))
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
            has_updates = bool(self._pending or self._bare_ids)
            if has_updates or self._report_due:
                load = self._engine.load()
                if has_updates or load != self._last_load:
                    self._last_load = load
                    message = self._message()
                    message.load.CopyFrom(load)
                    yield message
                if self._report_due:
                    self._report_due = False
                    self._report_timer = asyncio.get_running_loop().call_later(
                        self._engine.config.load_report_interval_s, self._report)
            if self._caller_done and not self._open and not self._pending and not self._bare_ids:
                return

    def _message(self) -> router_pb2.RouterStreamResponse:
        """The pending updates as one message (and none pending)."""
        pending, self._pending = self._pending, []
        message = router_pb2.RouterStreamResponse()
        if self._bare_ids:
            message.bare_request_ids.extend(self._bare_ids)
            message.bare_token_ids.extend(self._bare_token_ids)
            self._bare_ids, self._bare_token_ids = [], []
        self._updated.clear()
        add = message.updates.add
        for caller_id, request, event, counts in pending:
            update = add()
            update.request_id = caller_id  # set, not a keyword argument of `add`: half the cost
            if event.error is not None:
                code, text = convert.status_of(event.error)
                update.error_code, update.error_message = code.value[0], text
            else:
                convert.response_to_proto(event.token_ids, event.logprobs, request, event.finished,
                                          into=update.response, counts=counts)
        return message

    def _report(self) -> None:
        self._report_due = True
        self._ready.set()

    def token(self, caller_id: str, request: Request, reported: list[int] | None, token_id: int) -> None:
        """An event of one token and nothing else (see `EventSink.put_token`)."""
        if self._open.get(caller_id) is not request:
            return  # cancelled by the caller while the token waited in the engine's outbox
        if reported is None or not self._bare(caller_id, request, reported, token_id):
            self._update(caller_id, request, reported, StreamEvent([token_id], []))

    def event(self, caller_id: str, request: Request, reported: list[int] | None, event: StreamEvent) -> None:
        """One of the engine's events for an open request (see `_Sink`): always an update (the
        engine hands a plain token over by `token`). `reported`: where the caller reads bare
        tokens, the request's usage as its last update or bare token told it (completion, drafted
        and accepted tokens; completion -1 before its first update)."""
        if self._open.get(caller_id) is not request:
            return  # cancelled by the caller while the event waited in the engine's outbox
        if event.error is not None or event.finished:
            self._open.pop(caller_id, None)
        self._update(caller_id, request, reported, event)

    def _bare(self, caller_id: str, request: Request, reported: list[int], token_id: int) -> bool:
        """Put the token in the next message's bare columns if an update would say nothing more
        (its usage one completion token past the last one told, and no update of the request in
        that message yet); False: it must be an update."""
        draft = request.draft
        if (reported[0] != request.num_output - 1 or reported[1] != draft.num_drafted
                or reported[2] != draft.num_accepted or caller_id in self._updated):
            return False
        reported[0] += 1
        self._bare_ids.append(caller_id)
        self._bare_token_ids.append(token_id)
        self._ready.set()
        return True

    def _update(self, caller_id: str, request: Request, reported: list[int] | None, event: StreamEvent) -> None:
        counts = convert.usage_counts(request)
        if reported is not None:
            reported[:] = counts
            self._updated.add(caller_id)
        self._pending.append((caller_id, request, event, counts))
        self._ready.set()

    def _add_error(self, caller_id: str, error: RouterError) -> None:
        self._updated.add(caller_id)  # a refused duplicate's id may be open: keep its order
        self._pending.append((caller_id, None, StreamEvent(error=error), None))
        self._ready.set()


class _Sink:
    """Where the engine puts one request's events (in place of Generate's queue)."""

    __slots__ = ("put_nowait", "put_token")

    def __init__(self, stream: RequestStream, caller_id: str, request: Request, bare_tokens: bool) -> None:
        # `RequestStream.event` bound to the request, without a Python frame of its own: the
        # engine calls it for every request in every step.
        reported = [-1, 0, 0] if bare_tokens else None
        self.put_nowait: Callable[[StreamEvent], None] = functools.partial(stream.event, caller_id, request, reported)
        self.put_token: Callable[[int], None] = functools.partial(stream.token, caller_id, request, reported)
