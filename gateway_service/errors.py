"""Gateway errors and the one place where any failure becomes a gRPC status.

A request the caller got wrong is INVALID_ARGUMENT with a message that names the field; a
router failure keeps the router's status when it means something to the caller (UNAVAILABLE,
RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, CANCELLED); only a genuine bug becomes INTERNAL.
"""

from __future__ import annotations

import logging

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


# Router statuses passed through unchanged: each tells the caller what to do next (fix the
# request, back off, retry elsewhere, give more time).
_PASSED_THROUGH = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.FAILED_PRECONDITION,
}


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a caller sees for `exc`; logs what is not the caller's doing."""
    code, message = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        if isinstance(exc, grpc.aio.AioRpcError):
            log.error("router call failed with %s: %s", exc.code().name, exc.details() or "")
        elif not isinstance(exc, GatewayError):
            log.exception("unexpected gateway failure", exc_info=exc)
    return code, message


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """`to_status` without logging, for callers that only classify (metrics)."""
    if isinstance(exc, GatewayError):
        return exc.code, exc.message
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        details = exc.details() or code.name
        if code in _PASSED_THROUGH:
            return code, f"router: {details}"
        return grpc.StatusCode.INTERNAL, f"router failed ({code.name}): {details}"
    return grpc.StatusCode.INTERNAL, f"gateway failure: {type(exc).__name__}: {exc}"
