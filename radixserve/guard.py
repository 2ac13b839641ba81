"""The server-side gate every service puts in front of its handlers.

Two jobs, both done before a handler (and so any state of the service) is reached:
- **authentication**: when the server has accepted tokens, a call without
  `authorization: Bearer <one of them>` ends with UNAUTHENTICATED. The health service stays open,
  so that orchestrators' probes work without a secret (it tells nothing but SERVING or not).
- **decoding**: a request that is not a valid message (a string field that is not UTF-8, broken
  bytes) ends with INVALID_ARGUMENT. gRPC itself would answer UNKNOWN, because the failure
  happens in deserialization, before any handler runs.
"""

from __future__ import annotations

import contextlib
import hmac
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from radixserve.security import AUTH_HEADER, BEARER

log = logging.getLogger(__name__)

OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})
UNAUTHENTICATED_MESSAGE = "missing or invalid credentials"


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What the deserializer hands on instead of raising, so the handler can answer properly."""

    reason: str

    @property
    def message(self) -> str:
        if "UTF-8" in self.reason:
            return "the request is not valid: a string field is not UTF-8"
        return "the request is not a valid message"


def _service_of(method: str) -> str:
    """`/pkg.Service/Method` -> `pkg.Service`."""
    return method.lstrip("/").partition("/")[0]


class Guard(grpc.aio.ServerInterceptor):
    """Authenticates callers (when `tokens` is not empty) and decodes requests strictly."""

    def __init__(self, tokens: Sequence[str] = ()) -> None:
        self._tokens = tuple(t.encode() for t in tokens)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if self._tokens and _service_of(method) not in OPEN_SERVICES:
            if not self._authorized(handler_call_details.invocation_metadata or ()):
                log.warning("refused a call to %s: %s", method, UNAUTHENTICATED_MESSAGE)
                return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        return _strictly_decoding(handler)

    def _authorized(self, metadata) -> bool:
        presented = [
            value[len(BEARER):] for key, value in metadata
            if key == AUTH_HEADER and isinstance(value, str) and value.startswith(BEARER)
        ]
        return any(token_accepted(value, self._tokens) for value in presented)


def token_accepted(presented: str | None, tokens: Sequence[bytes]) -> bool:
    """Whether `presented` is one of `tokens`. Compared against every token with
    `compare_digest`: the time taken says nothing about which one was close. The one check
    for both APIs (gRPC metadata here, the HTTP API's Authorization header)."""
    if presented is None:
        return False
    value = presented.encode()
    return any([hmac.compare_digest(value, token) for token in tokens])


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    """A handler of the same kind as `handler` that ends the call with `code` at once.

    The request is not deserialized, and a streaming request is not read at all.
    """
    async def unary(request, context):
        await context.abort(code, message)

    async def streaming(request, context):
        await context.abort(code, message)
        yield  # never reached; makes this an async generator, as a streaming handler must be

    serialize = handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, response_serializer=serialize)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, response_serializer=serialize)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, response_serializer=serialize)
    return grpc.stream_stream_rpc_method_handler(streaming, response_serializer=serialize)


def _lenient(deserialize: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    if deserialize is None:
        return None

    def decode(raw: bytes) -> object:
        try:
            return deserialize(raw)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return decode


async def _reject_undecodable(request, context) -> None:
    if isinstance(request, Undecodable):
        log.info("refused an undecodable request: %s", request.reason)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


async def _checked_stream(requests: AsyncIterator, context) -> AsyncIterator:
    async for request in requests:
        await _reject_undecodable(request, context)
        yield request


def _strictly_decoding(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with a deserializer that never raises and a behaviour that answers
    INVALID_ARGUMENT for what could not be decoded."""
    deserialize = _lenient(handler.request_deserializer)
    serialize = handler.response_serializer
    if handler.unary_unary or handler.stream_unary:
        behaviour = handler.unary_unary or handler.stream_unary
        streamed_in = handler.stream_unary is not None

        async def unary_out(request, context):
            if streamed_in:
                request = _checked_stream(request, context)
            else:
                await _reject_undecodable(request, context)
            return await behaviour(request, context)

        make = grpc.stream_unary_rpc_method_handler if streamed_in else grpc.unary_unary_rpc_method_handler
        return make(unary_out, request_deserializer=deserialize, response_serializer=serialize)

    behaviour = handler.unary_stream or handler.stream_stream
    streamed_in = handler.stream_stream is not None
    if not inspect.isasyncgenfunction(behaviour):
        return handler  # a handler that writes with context.write: left as it is

    async def stream_out(request, context):
        if streamed_in:
            request = _checked_stream(request, context)
        else:
            await _reject_undecodable(request, context)
        # aclosing: when the caller goes away, the inner generator's cleanup runs now, not
        # whenever it is garbage collected.
        async with contextlib.aclosing(behaviour(request, context)) as responses:
            async for response in responses:
                yield response

    make = grpc.stream_stream_rpc_method_handler if streamed_in else grpc.unary_stream_rpc_method_handler
    return make(stream_out, request_deserializer=deserialize, response_serializer=serialize)
