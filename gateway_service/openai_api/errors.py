"""Failures as OpenAI error bodies: `{"error": {"message", "type", "param", "code"}}`.

The status of a failure is decided once, by `gateway_service.errors.to_status` (the same
mapping the gRPC API uses); this module only translates that gRPC status into HTTP. The few
failures that exist only in HTTP (413, an unknown route, a wrong method) say their HTTP status
themselves (`HttpError`).
"""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

from gateway_service.errors import GatewayError, to_status


class ModelNotFound(GatewayError):
    """The request names a model this gateway does not serve."""

    code = grpc.StatusCode.NOT_FOUND


class Unauthenticated(GatewayError):
    """No bearer token, or not the right one."""

    code = grpc.StatusCode.UNAUTHENTICATED


class HttpError(GatewayError):
    """A failure with its own HTTP status and OpenAI error type (the gRPC code is for metrics)."""

    http_status: int = 400
    error_type: str = "invalid_request_error"


class PayloadTooLarge(HttpError):
    """The body is over `--max-request-bytes` (gRPC's RESOURCE_EXHAUSTED for the same)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 413


class BodyTimeout(HttpError):
    """The body did not arrive whole within `--http-body-timeout-s` (a stalled or dribbling
    client holds a connection and a task for no more than that)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 408


class UnsupportedEncoding(HttpError):
    """The body is compressed (`Content-Encoding: gzip`...): read as it came it would be
    refused as invalid UTF-8, which says nothing of the cause."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 415


class RouteNotFound(HttpError):
    code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class MethodNotAllowed(HttpError):
    code = grpc.StatusCode.UNIMPLEMENTED
    http_status = 405


class ClientGone(GatewayError):
    """The client disconnected before its response was ready (nobody reads the answer)."""

    code = grpc.StatusCode.CANCELLED


# gRPC status -> (HTTP status, OpenAI error type).
_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
_INTERNAL = (500, "internal_error")
# The `code` field OpenAI's clients look at for these.
_CODES = {
    grpc.StatusCode.NOT_FOUND: "model_not_found",
    grpc.StatusCode.UNAUTHENTICATED: "invalid_api_key",
}


def error_body(exc: BaseException) -> tuple[int, dict]:
    """The HTTP status and OpenAI error body for `exc`."""
    code, message = to_status(exc)
    if isinstance(exc, HttpError):
        http_status, error_type, error_code = exc.http_status, exc.error_type, None
    else:
        (http_status, error_type), error_code = _HTTP.get(code, _INTERNAL), _CODES.get(code)
    return http_status, {
        "error": {"message": message, "type": error_type, "param": None, "code": error_code}
    }


# Seconds a client told "busy" (429) or "unavailable" (503) should wait before it retries: the
# openai client and most HTTP clients wait this long instead of guessing with their own backoff.
RETRY_AFTER_S = 1
_HEADERS = {401: {"WWW-Authenticate": "Bearer"}, 429: {"Retry-After": str(RETRY_AFTER_S)},
            503: {"Retry-After": str(RETRY_AFTER_S)}}


def error_response(exc: BaseException) -> JSONResponse:
    http_status, body = error_body(exc)
    return JSONResponse(body, status_code=http_status, headers=_HEADERS.get(http_status))
