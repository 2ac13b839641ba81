"""The gateway's side of `RouterService.Stream`: one call per router, shared by every request the
gateway sends there (the router's side, and why: router_service/request_stream.py).

Each request registers an inbox under its (unique) request id, opens itself on the call, and
reads its updates from the inbox; one reader task per call hands each message's updates to
their inboxes. A request that ends early (its caller cancelled, a stop string, its deadline)
sends a cancel. The call asks for bare tokens (radixserve/bare_tokens.py): a request's plain
tokens come as packed columns of the router's message, and `generate` gives them as `BareTokens`,
which read as the responses Generate would have streamed.

A request may also give a lane (`Lane`): a bare token's whole way to its caller, run by the reader
in place of waking the request's task and passing the token up its chain of generators. The
reader uses it only while the request's task waits on its inbox with nothing in it, so a token
in the lane never passes one that went the task's way, and the task learns of the lane's tokens
(for usage) at its next wake-up. A lane that declines a token (False) leaves it to the task; one
that raises fails its request alone with that exception. Failures look as they would on
Generate: a router's error update, the call breaking, or the deadline passing raise
`grpc.aio.AioRpcError` with the status Generate would have ended with, so failover and the
mapping to the caller's status stay as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeAlias

import grpc

from gateway_service.mailbox import Mailbox
from radixserve import bare_tokens
from radixserve.v1 import generation_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}
USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens", "draft_tokens", "accepted_draft_tokens")
_DEADLINE = object()  # what a request's deadline timer puts in its inbox
# How long a failed write waits for the call's own status from the reader.
WRITE_FAILURE_WAIT_S = 5.0
# A bare token's way to the caller without the request's task: True when it took the token.
Lane: TypeAlias = Callable[[int], bool]


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class RouterStream:
    """One open Stream call to one router. Once `failed` is set the call is over: every request
    on it got that error, and the pool opens a new call for the next request."""

    def __init__(
        self, stub: router_pb2_grpc.RouterServiceStub, metadata: Sequence[tuple[str, str]],
        on_load: Callable[[router_pb2.RouterLoad], None] | None = None,
    ) -> None:
        """`on_load` gets the router's load from every message that carries one."""
        self._call = stub.Stream(metadata=(*(metadata or ()), bare_tokens.METADATA))
        self._on_load = on_load
        self._inboxes: dict[str, Mailbox] = {}
        self._write_lock = asyncio.Lock()
        self.failed: grpc.aio.AioRpcError | None = None
        self.answered = False  # the router sent a message on this call
        self._abandoned = ""  # why `abandon` ended the call
        self._cancels: set[asyncio.Future] = set()
        self._reader = asyncio.ensure_future(self._read())

    async def generate(
        self, request: router_pb2.RouterGenerateRequest, deadline: float | None, lane: Lane | None = None,
    ) -> AsyncIterator[router_pb2.RouterGenerateResponse | BareTokens]:
        """The request's responses, as Generate would stream them (`deadline` on
        `time.monotonic()`); raises `grpc.aio.AioRpcError` as Generate would end.

        Updates that arrived while the caller was busy with an earlier response (a caller
        behind the router's steps) come as one response: their tokens and logprobs in order,
        the last one's usage and finish reason, as the router's Generate merges what piled up
        for a slow reader. A caller that keeps up gets one response per step. Bare tokens come
        as `BareTokens`, which has what the gateway reads of a response; with a `lane`, those
        that arrive while the caller waits go by the lane instead, from the first update on."""
        if self.failed is not None:
            raise self.failed
        request_id = request.request_id
        # The request's updates and bare tokens (ints), and at most one failure after them.
        inbox = _Inbox()
        self._inboxes[request_id] = inbox
        # The deadline is one timer that puts its error in the inbox, not a timeout per read.
        loop = asyncio.get_running_loop()
        timer = None if deadline is None else loop.call_at(
            loop.time() + deadline - time.monotonic(), inbox.put, _DEADLINE)
        ended = False
        usage: generation_pb2.Usage | _Usage | None = None  # as the last response told it
        try:
            await self._write(router_pb2.RouterStreamRequest(open=request))
            while not ended:
                if usage is not None:  # a bare token before the first update is the router's fault
                    inbox.lane = lane
                items = await inbox.take()
                if inbox.lane_tokens:  # they came before `items`
                    usage, inbox.lane_tokens = _Usage(usage, inbox.lane_tokens), 0
                if len(items) == 1 and _is_update(items[0]):  # a caller that keeps up: one step's token or update
                    end = 1
                else:
                    end = next((i for i, item in enumerate(items) if not _is_update(item)), len(items))
                if end:
                    response = _merged(items if end == len(items) else items[:end], usage)
                    usage, ended = response.usage, response.finish_reason != 0
                    yield response
                if ended or end == len(items):
                    continue
                failure = items[end]
                if failure is _DEADLINE:  # still open on the router: cancelled below
                    raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
                if not isinstance(failure, (grpc.aio.AioRpcError, router_pb2.RouterStreamUpdate)):
                    raise failure  # the lane's: still open on the router, cancelled below
                ended = True
                if isinstance(failure, grpc.aio.AioRpcError):
                    raise failure
                code = _CODES.get(failure.error_code, grpc.StatusCode.UNKNOWN)
                raise rpc_error(code, failure.error_message)
        finally:
            if timer is not None:
                timer.cancel()
            del self._inboxes[request_id]
            if not ended and self.failed is None:
                # Not awaited here: a generator being closed must not wait on the network. (The
                # loop keeps only weak references to tasks: `_cancels` holds it until it is done.)
                task = asyncio.ensure_future(self._cancel(request_id))
                self._cancels.add(task)
                task.add_done_callback(self._cancels.discard)

    def abandon(self, reason: str) -> None:
        """End the call: every request on it fails with UNAVAILABLE `reason` (the router stopped
        answering, see `RouterPool`)."""
        self._abandoned = reason
        self._call.cancel()

    async def close(self) -> None:
        self._call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    async def _read(self) -> None:
        try:
            async for message in self._call:
                self.answered = True
                if self._on_load is not None and message.HasField("load"):
                    self._on_load(message.load)
                inboxes = self._inboxes
                # A message's bare tokens come before its updates (router.proto).
                bare_ids, bare_token_ids = message.bare_request_ids, message.bare_token_ids
                if len(bare_ids) != len(bare_token_ids):  # a router bug: no telling whose token is whose
                    self._call.cancel()
                    raise _RouterFault(f"the router sent {len(bare_token_ids)} bare tokens for {len(bare_ids)} request ids")
                for request_id, token_id in zip(bare_ids, bare_token_ids):
                    inbox = inboxes.get(request_id)
                    if inbox is None:
                        continue
                    lane = inbox.lane
                    if lane is None or not inbox.parked():
                        inbox.put(token_id)
                        continue
                    try:
                        taken = lane(token_id)
                    except Exception as exc:  # the request's failure alone, raised in its task
                        inbox.lane = None
                        inbox.put(exc)
                        continue
                    if taken:
                        inbox.lane_tokens += 1
                    else:
                        inbox.put(token_id)
                for update in message.updates:
                    inbox = inboxes.get(update.request_id)
                    if inbox is not None:  # else: cancelled by its caller meanwhile
                        inbox.put(update)
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the router ended the stream")
        except _RouterFault as exc:
            error = rpc_error(grpc.StatusCode.INTERNAL, str(exc))
        except grpc.aio.AioRpcError as exc:
            error = exc
            if self.answered and exc.code() in _BROKEN:
                # The router ends a call it answered on only by finishing it: this status is
                # grpc's own for a call that broke under it (the router stopping mid-call, say).
                # Its requests lost their router, as with a connection reset: UNAVAILABLE.
                error = rpc_error(grpc.StatusCode.UNAVAILABLE,
                                  f"the stream to the router broke ({exc.code().name}: {exc.details()})")
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, self._abandoned or "the gateway closed the stream")
        self.failed = error
        if self._inboxes:
            log.warning("stream to the router ended with %s: failing %d request(s)", error.code().name, len(self._inboxes))
        for inbox in self._inboxes.values():
            inbox.put(error)

    async def _write(self, message: router_pb2.RouterStreamRequest) -> None:
        async with self._write_lock:
            if self.failed is not None:
                raise self.failed
            try:
                await self._call.write(message)
            except (grpc.aio.UsageError, asyncio.InvalidStateError, grpc.aio.AioRpcError) as exc:
                # The call ended meanwhile; its status is what the reader reports (a write that
                # lost the race to the router's answer, say UNIMPLEMENTED from a router without
                # Stream, can fail with grpc's own "Internal error from Core" instead).
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._reader), WRITE_FAILURE_WAIT_S)
                if self.failed is not None:
                    raise self.failed from None
                raise exc if isinstance(exc, grpc.aio.AioRpcError) else rpc_error(
                    grpc.StatusCode.UNAVAILABLE, str(exc)) from None

    async def _cancel(self, request_id: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            await self._write(router_pb2.RouterStreamRequest(cancel=request_id))


class _RouterFault(Exception):
    """A message the gateway cannot read (a router bug): the call fails with INTERNAL."""


# What a Stream call the router answered on ends with when it breaks rather than ends: grpc's
# "Internal error from Core", or a cancel from the server's side (the reader's own cancel is
# asyncio's CancelledError).
_BROKEN = (grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED)


class _Inbox(Mailbox):
    """A request's inbox on the call: updates, bare tokens and failures for its task, and the
    lane the reader may use instead (with the count of tokens it took since the task's wake-up)."""

    __slots__ = ("lane", "lane_tokens")

    def __init__(self) -> None:
        super().__init__()
        self.lane: Lane | None = None
        self.lane_tokens = 0


def _is_update(item) -> bool:
    """An update or a bare token (not a failure)."""
    return type(item) is int or isinstance(item, router_pb2.RouterStreamUpdate) and not item.error_code


def _bare_first() -> grpc.aio.AioRpcError:
    """A router bug: it sends a request's first tokens as an update, which tells their usage."""
    return rpc_error(grpc.StatusCode.INTERNAL, "the router sent a bare token before the request's first update")


class _Usage:
    """A request's usage as a bare token leaves it (reads as `generation_pb2.Usage`): the last
    update's, taken once, plus the bare tokens since. Made for every bare token, so it holds two
    fields and reads the rest on demand (few read it: see `GenerationServicer`)."""

    __slots__ = ("_base", "_extra")

    def __init__(self, before: generation_pb2.Usage | _Usage, num_tokens: int) -> None:
        if type(before) is _Usage:
            self._base, self._extra = before._base, before._extra + num_tokens
        else:
            self._base = tuple(getattr(before, name) for name in USAGE_FIELDS)
            self._extra = num_tokens

    @property
    def prompt_tokens(self) -> int:
        return self._base[0]

    @property
    def completion_tokens(self) -> int:
        return self._base[1] + self._extra

    @property
    def cached_tokens(self) -> int:
        return self._base[2]

    @property
    def draft_tokens(self) -> int:
        return self._base[3]

    @property
    def accepted_draft_tokens(self) -> int:
        return self._base[4]


class BareTokens:
    """Bare tokens of one request (router.proto), read as a `RouterGenerateResponse`: the tokens,
    no logprobs, no finish reason, and the usage they bring the request to."""

    __slots__ = ("token_ids", "usage")
    logprobs: Sequence[generation_pb2.TokenLogprob] = ()
    finish_reason = generation_pb2.FINISH_REASON_UNSPECIFIED

    def __init__(self, token_ids: list[int], before: generation_pb2.Usage | _Usage | None) -> None:
        if before is None:
            raise _bare_first()
        self.token_ids = token_ids
        self.usage = _Usage(before, len(token_ids))


def _merged(
    items: list[router_pb2.RouterStreamUpdate | int], usage: generation_pb2.Usage | _Usage | None,
) -> router_pb2.RouterGenerateResponse | BareTokens:
    """One response for consecutive updates and bare tokens of a request, `usage` as the one
    before them left it: usage (cumulative) and finish reason are the last one's."""
    if len(items) == 1:
        item = items[0]
        return BareTokens(items, usage) if type(item) is int else item.response
    if all(type(item) is int for item in items):
        return BareTokens(items, usage)
    merged = router_pb2.RouterGenerateResponse()
    num_bare = 0  # bare tokens since the last update's usage
    for item in items:
        if type(item) is int:
            if usage is None:
                raise _bare_first()
            merged.token_ids.append(item)
            num_bare += 1
            continue
        response = item.response
        merged.token_ids.extend(response.token_ids)
        merged.logprobs.extend(response.logprobs)
        merged.finish_reason = response.finish_reason
        usage, num_bare = response.usage, 0
    last = _Usage(usage, num_bare)
    for name in USAGE_FIELDS:
        setattr(merged.usage, name, getattr(last, name))
    return merged
