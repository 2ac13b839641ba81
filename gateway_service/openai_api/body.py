"""A request body, bounded, parsed and typed before it costs more than its size allows.

The order is the point: the route's token check has run on the headers alone (the body is
not read for a caller without a token); a compressed body (`Content-Encoding` other than
identity) is 415 before any byte is read; then `Content-Length` over `--max-request-bytes` is 413
before any byte is read, and a body that streams past it (chunked) is 413 as soon as it does;
a body that has not arrived whole `--http-body-timeout-s` after its head is 408 (`BodyTimeout`),
and a client that disconnects while sending it is `ClientGone`, not a failure of ours;
then the bytes must be UTF-8 JSON, nested at most `MAX_DEPTH` deep, with no string that cannot
be encoded (a lone surrogate escape such as `"\\ud800"`), and the JSON must fit the route's
model with strict types (`"stream": "yes"` is not a boolean). Every failure is an
`InvalidRequest` naming what is wrong, or `PayloadTooLarge`. Parsing and validating a large
body runs on a thread, so the event loop keeps serving streams meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

import pydantic
from fastapi import Request

from starlette.requests import ClientDisconnect

from gateway_service.errors import InvalidRequest
from gateway_service.openai_api.errors import BodyTimeout, ClientGone, PayloadTooLarge, UnsupportedEncoding
from gateway_service.validation import RequestLimits

Model = TypeVar("Model", bound=pydantic.BaseModel)
# Deeper than any OpenAI body or sensible JSON schema; a deeper one is refused before pydantic
# walks it.
MAX_DEPTH = 64
# Bodies up to this size are parsed on the event loop (cheaper than a thread hand-off).
PARSE_ON_LOOP_BYTES = 64 * 1024


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body, refused with `PayloadTooLarge` as soon as it passes `max_bytes`, with
    `BodyTimeout` when it is not whole `timeout_s` from now."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", ""):
        raise UnsupportedEncoding(f"Content-Encoding {encoding!r} is not supported: send the body uncompressed")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidRequest("Content-Length is not a number")
        if int(declared) > max_bytes:
            raise PayloadTooLarge(f"the body has {declared} bytes, more than the limit of {max_bytes}")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise PayloadTooLarge(f"the body is longer than the limit of {max_bytes} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeout(f"the body did not arrive within {timeout_s:g} s ({size} bytes came)") from None
    except ClientDisconnect:
        raise ClientGone("the client disconnected while sending the body") from None
    return b"".join(chunks)


async def parse_body(request: Request, model: type[Model], limits: RequestLimits) -> Model:
    body = await read_body(request, limits.max_request_bytes, limits.http_body_timeout_s)
    if len(body) > PARSE_ON_LOOP_BYTES:
        return await asyncio.to_thread(parse, body, model)
    return parse(body, model)


def parse(body: bytes, model: type[Model]) -> Model:
    """`body` as `model`, or `InvalidRequest` saying why not."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the body is not valid UTF-8 (at byte {exc.start})") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidRequest(f"the body is nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    check_tree(value)
    try:
        return model.model_validate(value, strict=True)
    except pydantic.ValidationError as exc:
        raise InvalidRequest(describe(exc)) from None


def check_tree(value: Any) -> None:
    """Nesting within `MAX_DEPTH`, and every string (keys too) encodable as UTF-8."""
    pending: list[tuple[Any, str, int]] = [(value, "body", 0)]
    while pending:
        item, path, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise InvalidRequest(f"the body is nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, path)
                pending.append((child, f"{path}.{key}" if path != "body" else key, depth + 1))
        elif isinstance(item, list):
            pending.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"{path}: not valid Unicode (a lone surrogate at character {exc.start})") from None


def describe(exc: pydantic.ValidationError) -> str:
    """pydantic's errors as `field.path: message; ...`."""
    return "; ".join(
        f"{'.'.join(str(p) for p in error['loc']) or 'body'}: {error['msg']}" for error in exc.errors()
    ) or "malformed request body"
