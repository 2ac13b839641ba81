"""The HTTP routes beside generation: `/tokenize` and `/detokenize` (vLLM's request and response
shapes), and `GET /v1/models/{id}`.

They go through the servicer's Tokenize and detokenize code, so limits and errors are the gRPC
API's. `model` is optional in the tokenizer routes (as in vLLM); when given it must be the
served one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict

from gateway_service.openai_api import tool_protocol
from gateway_service.openai_api.body import parse_body
from gateway_service.openai_api.errors import ModelNotFound
from gateway_service.openai_api.unsupported import DETOKENIZE, MESSAGE, TOKENIZE, refuse_unsupported
from gateway_service.service import GenerationServicer
from gateway_service.validation import RequestLimits
from radixserve.v1 import generation_pb2


class _Body(BaseModel):
    # Undeclared fields are kept for `unsupported.refuse_unsupported`.
    model_config = ConfigDict(extra="allow")


class _Message(_Body):
    role: str
    content: str | None = None
    tool_calls: list[tool_protocol.ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class TokenizeBody(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[_Message] | None = None
    # Prompt: the tokenizer's own special tokens. Messages: the template holds its own, so
    # vLLM's default for them is false; true adds them once more.
    add_special_tokens: bool | None = None
    # Messages only (default true).
    add_generation_prompt: bool | None = None
    tools: list[tool_protocol.ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[int]


def model_card(info: generation_pb2.GetModelInfoResponse) -> dict:
    return {"id": info.model_name, "object": "model", "created": 0, "owned_by": "radixserve",
            "max_model_len": info.context_len, "quantization": info.quantization}


def add_text_routes(
    app: FastAPI, servicer: GenerationServicer, authenticated: Callable[..., Awaitable[None]],
    answers_errors: Callable[[Callable[..., Awaitable]], Callable[..., Awaitable]], limits: RequestLimits,
) -> None:
    """Adds the routes, each behind `authenticated` (checked before the body is read), bodies
    bounded and strictly parsed as the generation routes' are, errors answered as OpenAI bodies."""

    async def check_model(model: str | None) -> generation_pb2.GetModelInfoResponse:
        info = await servicer.model_info()
        if model is not None and model != info.model_name:
            raise ModelNotFound(f"the model {model!r} does not exist; this server serves {info.model_name!r}")
        return info

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"], dependencies=[Depends(authenticated)])
    @answers_errors
    async def model(model_id: str) -> dict:
        return model_card(await check_model(model_id))

    @app.post("/tokenize", dependencies=[Depends(authenticated)])
    @answers_errors
    async def tokenize(request: Request) -> dict:
        body = await parse_body(request, TokenizeBody, limits)
        refuse_unsupported(body.model_extra, TOKENIZE)
        for index, message in enumerate(body.messages or ()):
            refuse_unsupported(message.model_extra, MESSAGE, f"messages[{index}].")
        info = await check_model(body.model)
        request = generation_pb2.TokenizeRequest(
            prompt=body.prompt or "",
            messages=[
                generation_pb2.ChatMessage(role=m.role, content=m.content or "", **tool_protocol.history_fields(m))
                for m in body.messages or ()
            ],
            tools=tool_protocol.tool_messages(body.tools),
            chat_template_kwargs=tool_protocol.template_kwargs_text(body.chat_template_kwargs),
        )
        if body.add_generation_prompt is not None:
            request.add_generation_prompt = body.add_generation_prompt
        if body.add_special_tokens is not None:
            request.add_special_tokens = body.add_special_tokens
        token_ids = list((await servicer.tokenize(request)).token_ids)
        return {"count": len(token_ids), "max_model_len": info.context_len, "tokens": token_ids}

    @app.post("/detokenize", dependencies=[Depends(authenticated)])
    @answers_errors
    async def detokenize(request: Request) -> dict:
        body = await parse_body(request, DetokenizeBody, limits)
        refuse_unsupported(body.model_extra, DETOKENIZE)
        await check_model(body.model)
        return {"prompt": await servicer.detokenize(body.tokens)}
