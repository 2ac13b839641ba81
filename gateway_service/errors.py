"""Gateway errors and the one place where any failure becomes a gRPC status.

A request the caller got wrong is INVALID_ARGUMENT with a message that names the field; a
router failure keeps the router's status when it means something to the caller (UNAVAILABLE,
RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, CANCELLED); only a genuine bug becomes INTERNAL.

What the caller reads never holds internal detail (router or worker addresses, other requests'
ids, exception text): the router's INVALID_ARGUMENT is about the caller's own request and passes
through; every other failure gets a fixed message, and the detail goes to the gateway's log. An
INTERNAL error carries a reference that appears in the log line too.
"""

from __future__ import annotations

import logging
import uuid

import grpc

log = logging.getLogger(__name__)


class GatewayError(Exception):
    """A failure with the gRPC status code the caller should see."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidRequest(GatewayError):
    """The caller's request is malformed or out of range."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NoRouterAvailable(GatewayError):
    """No router replica could take the request."""

    code = grpc.StatusCode.UNAVAILABLE


class ShuttingDown(GatewayError):
    """The gateway is draining: it finishes what it has and takes nothing new."""

    code = grpc.StatusCode.UNAVAILABLE


# Router statuses whose code passes through: each tells the caller what to do next (fix the
# request, back off, retry elsewhere, give more time). The message is ours, except for
# INVALID_ARGUMENT, which describes the caller's own request.
_PASSED_THROUGH = {
    grpc.StatusCode.INVALID_ARGUMENT: "",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the server is busy; retry later",
    grpc.StatusCode.UNAVAILABLE: "the model is unavailable right now; retry later",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the deadline passed before the request finished",
    grpc.StatusCode.CANCELLED: "the request was cancelled",
    grpc.StatusCode.FAILED_PRECONDITION: "the request cannot be served now",
}


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a caller sees for `exc`; logs what is not the caller's doing
    (an internal failure with a reference the caller's message carries)."""
    code = status_of(exc)
    if isinstance(exc, GatewayError) and code != grpc.StatusCode.INTERNAL:
        return code, exc.message
    if isinstance(exc, grpc.aio.AioRpcError):
        details = exc.details() or exc.code().name
        if code != grpc.StatusCode.INTERNAL:
            log.info("router answered %s: %s", code.name, details)
            return code, _PASSED_THROUGH[code] or details
        return _internal(f"router call failed with {exc.code().name}: {details}")
    return _internal("unexpected gateway failure", exc)


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The status code of `to_status` alone, without logging, for callers that only classify
    (metrics)."""
    if isinstance(exc, GatewayError):
        return exc.code
    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _PASSED_THROUGH:
        return exc.code()
    return grpc.StatusCode.INTERNAL


def _internal(what: str, exc: BaseException | None = None) -> tuple[grpc.StatusCode, str]:
    reference = uuid.uuid4().hex[:12]
    log.error("%s (reference %s)", what, reference, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (reference {reference})"
