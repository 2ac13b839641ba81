"""The FastAPI application: OpenAI's routes over the gateway's `GenerationServicer`.

Every generation goes through `GenerationServicer.generate`, like a gRPC Generate call, so
validation, routing, stop strings and metrics are the same code. Errors become OpenAI error
bodies in `openai_api.errors`. A streamed response is returned only once its first chunk (or
its first error) is known, so that a bad request or a full queue is an HTTP status, not an
error inside a 200 stream.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway_service.errors import InvalidRequest
from gateway_service.metrics import API_CHAT, API_COMPLETIONS
from gateway_service.openai_api import responses as bodies
from gateway_service.openai_api.choices import ChoiceStreams, with_choice_seeds
from gateway_service.openai_api.errors import (
    ClientGone,
    ModelNotFound,
    Unauthenticated,
    error_body,
    error_response,
)
from gateway_service.openai_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_input,
    completion_inputs,
)
from gateway_service.service import GenerationServicer
from radixserve.v1 import generation_pb2

# Checks a bearer token (None when the request sent none): True lets the request through.
TokenCheck = Callable[[str | None], bool]
SSE_MEDIA_TYPE = "text/event-stream"
BEARER = "bearer "


def build_app(
    servicer: GenerationServicer,
    max_choices: int,
    is_serving: Callable[[], bool],
    token_check: TokenCheck | None = None,
) -> FastAPI:
    """The HTTP API. With `token_check`, every `/v1/` route needs `Authorization: Bearer`."""
    app = FastAPI(title="radixserve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestValidationError)
    async def malformed_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc'][1:]) or 'body'}: {error['msg']}"
            for error in exc.errors()
        )
        return error_response(InvalidRequest(problems or "malformed request body"))

    async def authenticated(request: Request) -> None:
        if token_check is None:
            return
        header = request.headers.get("authorization", "")
        token = header[len(BEARER):].strip() if header.lower().startswith(BEARER) else None
        if not token_check(token or None):
            raise Unauthenticated("a valid bearer token is required (Authorization: Bearer <token>)")

    async def served_model(model: str) -> str:
        info = await servicer.model_info()
        if model != info.model_name:
            raise ModelNotFound(f"the model {model!r} does not exist; this server serves {info.model_name!r}")
        return info.model_name

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if is_serving() else 503)

    @app.get("/v1/models", dependencies=[Depends(authenticated)])
    @_answers_errors
    async def models() -> dict:
        info = await servicer.model_info()
        return {"object": "list", "data": [{
            "id": info.model_name, "object": "model", "created": 0, "owned_by": "radixserve",
            "max_model_len": info.context_len, "quantization": info.quantization,
        }]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authenticated)])
    @_answers_errors
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        model = await served_model(body.model)
        inputs = with_choice_seeds([chat_input(body, max_choices)], body.n)
        streams = ChoiceStreams(lambda r: servicer.generate(r, None, API_CHAT), inputs)
        if body.stream:
            header = bodies.ResponseHeader.new("chatcmpl", bodies.CHAT_CHUNK_OBJECT, model)
            return await _event_stream(streams, _chat_events(header, body, len(inputs)))
        header = bodies.ResponseHeader.new("chatcmpl", bodies.CHAT_OBJECT, model)
        outputs = await _collect(streams, len(inputs), request)
        return JSONResponse(header.body(
            choices=[bodies.chat_choice(i, out, body.logprobs) for i, out in enumerate(outputs)],
            usage=bodies.usage_body([out.usage for out in outputs]),
        ))

    @app.post("/v1/completions", dependencies=[Depends(authenticated)])
    @_answers_errors
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model = await served_model(body.model)
        prompts = completion_inputs(body, max_choices)
        inputs = with_choice_seeds(prompts, body.n)
        streams = ChoiceStreams(lambda r: servicer.generate(r, None, API_COMPLETIONS), inputs)
        header = bodies.ResponseHeader.new("cmpl", bodies.COMPLETION_OBJECT, model)
        if body.stream:
            return await _event_stream(streams, _completion_events(header, body, inputs, len(prompts)))
        outputs = await _collect(streams, len(inputs), request)
        with_logprobs = body.logprobs is not None
        return JSONResponse(header.body(
            choices=[
                bodies.completion_choice(i, "".join(out.text), out.logprobs if with_logprobs else None,
                                         out.finish_reason)
                for i, out in enumerate(outputs)
            ],
            usage=bodies.usage_body([out.usage for out in outputs], len(prompts)),
        ))

    @app.exception_handler(Unauthenticated)
    async def unauthenticated(request: Request, exc: Unauthenticated) -> JSONResponse:
        return error_response(exc)

    return app


def _answers_errors(route: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
    """Any failure of `route` becomes its OpenAI error response (status from `to_status`)."""

    @functools.wraps(route)
    async def answering(*args, **kwargs):
        try:
            return await route(*args, **kwargs)
        except Exception as exc:
            return error_response(exc)

    return answering


async def _collect(streams: ChoiceStreams, num_choices: int, request: Request) -> list[bodies.ChoiceOutput]:
    """Every choice's whole output. A client that disconnects meanwhile cancels the choices at
    once (their router calls, so their pages come back), as a dropped stream does."""
    outputs = [bodies.ChoiceOutput() for _ in range(num_choices)]

    async def read() -> None:
        async for index, chunk in streams:
            outputs[index].add(chunk)

    reading = asyncio.ensure_future(read())
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([reading, watching], return_when=asyncio.FIRST_COMPLETED)
        if not reading.done():
            raise ClientGone("the client disconnected")
        reading.result()  # raises what failed the choices
        return outputs
    finally:
        for task in (reading, watching):
            task.cancel()
        await asyncio.gather(reading, watching, return_exceptions=True)
        await streams.aclose()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is read, so nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# An event formatter turns (index, chunk) into SSE payloads; None marks the end of all choices.
Events = Callable[[int | None, generation_pb2.GenerateResponse | None], list[dict]]


async def _event_stream(streams: ChoiceStreams, events: Events) -> Response:
    """A server-sent-event response, or an error response when the first chunk fails."""
    chunks = streams.__aiter__()
    try:
        first = await anext(chunks, None)
    except Exception as exc:
        await streams.aclose()
        return error_response(exc)

    async def sse() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                for payload in events(*first):
                    yield _sse(payload)
            try:
                async for index, chunk in chunks:
                    for payload in events(index, chunk):
                        yield _sse(payload)
                for payload in events(None, None):
                    yield _sse(payload)
            except Exception as exc:  # the status line is sent: report the error in-stream
                yield _sse(error_body(exc)[1])
            yield b"data: [DONE]\n\n"
        finally:
            await streams.aclose()

    return StreamingResponse(sse(), media_type=SSE_MEDIA_TYPE,
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class _UsageTotals:
    """Usage of the finished choices, for the final chunk of `stream_options.include_usage`."""

    def __init__(self, num_choices: int) -> None:
        self.usages: list = [None] * num_choices

    def add(self, index: int, chunk: generation_pb2.GenerateResponse) -> None:
        if chunk.HasField("usage"):
            self.usages[index] = chunk.usage

    def body(self, num_prompts: int) -> dict:
        return bodies.usage_body([u for u in self.usages if u is not None], num_prompts)


def _chat_events(header: bodies.ResponseHeader, body: ChatCompletionRequest, num_choices: int) -> Events:
    started: set[int] = set()
    totals = _UsageTotals(num_choices)
    extra = {"usage": None} if body.include_usage else {}

    def events(index: int | None, chunk: generation_pb2.GenerateResponse | None) -> list[dict]:
        if index is None:
            return [header.body(choices=[], usage=totals.body(1))] if body.include_usage else []
        totals.add(index, chunk)
        first = index not in started
        started.add(index)
        return [header.body(choices=[bodies.chat_delta(index, chunk, body.logprobs, first)], **extra)]

    return events


def _completion_events(header: bodies.ResponseHeader, body: CompletionRequest,
                       inputs: Sequence[generation_pb2.GenerateRequest], num_prompts: int) -> Events:
    offsets = [0] * len(inputs)
    totals = _UsageTotals(len(inputs))
    extra = {"usage": None} if body.include_usage else {}
    with_logprobs = body.logprobs is not None

    def events(index: int | None, chunk: generation_pb2.GenerateResponse | None) -> list[dict]:
        if index is None:
            return [header.body(choices=[], usage=totals.body(num_prompts))] if body.include_usage else []
        totals.add(index, chunk)
        choice = bodies.completion_choice(index, chunk.text, chunk.logprobs if with_logprobs else None,
                                          chunk.finish_reason, offsets[index])
        offsets[index] += len(chunk.text)
        return [header.body(choices=[choice], **extra)]

    return events
