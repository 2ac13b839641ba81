"""Typed errors: every failed call raises a `RadixServeError` subclass named after its status."""

from __future__ import annotations

import grpc


class RadixServeError(Exception):
    """A call failed; `code` is the gRPC status code, `message` the server's explanation."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        if code is not None:
            self.code = code
        super().__init__(f"{self.code.name}: {message}")
        self.message = message


class InvalidArgumentError(RadixServeError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class UnavailableError(RadixServeError):
    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhaustedError(RadixServeError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceededError(RadixServeError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class CancelledError(RadixServeError):
    """The call was cancelled (not to be confused with asyncio.CancelledError)."""

    code = grpc.StatusCode.CANCELLED


class InternalError(RadixServeError):
    code = grpc.StatusCode.INTERNAL


class UnauthenticatedError(RadixServeError):
    """No API token, or one the gateway does not accept."""

    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: dict[grpc.StatusCode, type[RadixServeError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError, UnavailableError, ResourceExhaustedError,
        DeadlineExceededError, CancelledError, InternalError, UnauthenticatedError,
    )
}


def from_rpc_error(error: grpc.RpcError) -> RadixServeError:
    """The typed error for a failed gRPC call (sync or asyncio)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    return _typed(code, details)


def from_status(code: int, message: str) -> RadixServeError:
    """The typed error for a status given as its number (a GenerateMany update's `code`)."""
    return _typed(_BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN), message)


def _typed(code: grpc.StatusCode, message: str) -> RadixServeError:
    cls = _BY_CODE.get(code)
    return RadixServeError(message, code) if cls is None else cls(message)


_BY_NUMBER = {status.value[0]: status for status in grpc.StatusCode}
