"""`POST /v1/embeddings`: OpenAI's request and response shapes over the servicer's Embed.

`input` is a text, a list of texts, a list of token ids, or a list of such lists (OpenAI's four
shapes); each becomes one `EmbedInput`. `encoding_format` is `float` (JSON numbers) or `base64`
(the float32 values' little-endian bytes, which the official client asks for by default and
decodes itself). `dimensions` must be the model's own size (see embedding.py); `user` is logged
only, as for generation.
"""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict

from gateway_service.caller import Caller
from gateway_service.errors import InvalidRequest
from gateway_service.metrics import API_EMBEDDINGS
from gateway_service.openai_api.body import parse_body
from gateway_service.openai_api.errors import ModelNotFound
from gateway_service.openai_api.protocol import INT32_MAX, INT32_MIN
from gateway_service.openai_api.unsupported import EMBEDDINGS, refuse_unsupported
from gateway_service.service import GenerationServicer
from gateway_service.validation import RequestLimits, check_user
from radixserve.v1 import generation_pb2


class EmbeddingRequest(BaseModel):
    # Undeclared fields are kept for `unsupported.refuse_unsupported`.
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def embed_request(body: EmbeddingRequest) -> generation_pb2.EmbedRequest:
    request = generation_pb2.EmbedRequest(inputs=[_input(item) for item in _items(body.input)])
    if body.dimensions is not None:
        request.dimensions = min(max(body.dimensions, INT32_MIN), INT32_MAX)
    return request


def _items(given: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(given, str):
        return [given]
    if given and all(isinstance(item, int) for item in given):
        return [given]  # one list of token ids is one input
    return list(given)


def _input(item: str | list[int]) -> generation_pb2.EmbedInput:
    if isinstance(item, str):
        return generation_pb2.EmbedInput(text=item)
    # Past int32 is outside every vocabulary: clamped, it is refused naming the input.
    return generation_pb2.EmbedInput(tokens=generation_pb2.TokenIds(
        token_ids=[min(max(token_id, INT32_MIN), INT32_MAX) for token_id in item]))


def _vector(values, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return list(values)


def add_embedding_routes(
    app: FastAPI, servicer: GenerationServicer, authenticated: Callable[..., Awaitable[None]],
    answers_errors: Callable[[Callable[..., Awaitable]], Callable[..., Awaitable]],
    limits: RequestLimits, caller_of: Callable[[Request, str | None], Caller],
) -> None:
    """Adds the route behind `authenticated`, its body bounded and strictly parsed as the
    generation routes' are, errors answered as OpenAI bodies."""

    @app.post("/v1/embeddings", dependencies=[Depends(authenticated)])
    @answers_errors
    async def embeddings(request: Request) -> dict:
        started, caller = time.monotonic(), caller_of(request)
        try:
            body = await parse_body(request, EmbeddingRequest, limits)
            refuse_unsupported(body.model_extra, EMBEDDINGS)
            if body.user is not None:
                check_user(body.user, limits)
                caller = caller_of(request, body.user)
            info = await servicer.model_info()
            if body.model != info.model_name:
                raise ModelNotFound(f"the model {body.model!r} does not exist; this server serves {info.model_name!r}")
            if not body.input:
                raise InvalidRequest("input is empty")
        except Exception as exc:  # refused before it started: counted and logged all the same
            servicer.metrics.rejected(API_EMBEDDINGS, caller, exc, started)
            raise
        response = await servicer.embed(embed_request(body), caller, None, API_EMBEDDINGS)
        num_tokens = response.usage.prompt_tokens
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": index, "embedding": _vector(item.values, body.encoding_format)}
                     for index, item in enumerate(response.embeddings)],
            "model": info.model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
