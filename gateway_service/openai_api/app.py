"""The FastAPI application: OpenAI's routes over the gateway's `GenerationServicer`.

Every generation goes through `GenerationServicer.generate`, like a gRPC Generate call, so
validation, routing, stop strings and metrics are the same code. Errors become OpenAI error
bodies in `openai_api.errors`, unknown routes and methods included. A streamed response is
returned only once its first chunk (or its first error) is known, so that a bad request or a
full queue is an HTTP status, not an error inside a 200 stream; an error after that (the
gateway's drain ending the stream, a router failure) is an error event, then `[DONE]`.

A POST is taken in this order: the bearer token from the headers (401 without reading the
body), the body bounded and parsed (`openai_api.body`), the model, then the generation.
Every request refused before its generation started is counted and logged by
`GatewayMetrics.rejected`; the generation itself by `GatewayMetrics.observe`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from gateway_service.caller import Caller, client_key
from gateway_service.choice_streams import ChoiceStreams
from gateway_service.errors import InvalidRequest
from gateway_service.metrics import API_CHAT, API_COMPLETIONS, ROUTES
from gateway_service.openai_api import responses as bodies
from gateway_service.openai_api.body import describe, parse_body
from gateway_service.openai_api.choices import with_choice_seeds
from gateway_service.openai_api.errors import (
    ClientGone,
    HttpError,
    MethodNotAllowed,
    ModelNotFound,
    RouteNotFound,
    Unauthenticated,
    error_body,
    error_response,
)
from gateway_service.openai_api import sse
from gateway_service.openai_api.request_ids import STATE_KEY, RequestIds
from gateway_service.openai_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_input,
    completion_inputs,
)
from gateway_service.openai_api.embedding_routes import add_embedding_routes
from gateway_service.openai_api.text_routes import add_text_routes, model_card
from gateway_service.service import GenerationServicer
from gateway_service.validation import RequestLimits, check_user
from radixserve.v1 import generation_pb2

# Checks a bearer token (None when the request sent none): True lets the request through.
TokenCheck = Callable[[str | None], bool]
BEARER = "bearer "
API_OF_ROUTE = {route: api for api, route in ROUTES.items()}


def build_app(
    servicer: GenerationServicer,
    max_choices: int,
    is_serving: Callable[[], bool],
    limits: RequestLimits,
    token_check: TokenCheck | None = None,
) -> FastAPI:
    """The HTTP API. With `token_check`, every `/v1/` route needs `Authorization: Bearer`."""
    app = FastAPI(title="radixserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestIds, max_len=limits.max_request_id_len)

    @app.exception_handler(RequestValidationError)
    async def malformed_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(InvalidRequest(describe(exc)))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            return error_response(RouteNotFound(f"no such route: {where}"))
        if exc.status_code == 405:
            return error_response(MethodNotAllowed(f"method not allowed: {where}"))
        failure = HttpError(str(exc.detail))
        failure.http_status = exc.status_code
        return error_response(failure)

    def caller_of(request: Request, user: str | None = None) -> Caller:
        request_id = getattr(request.state, STATE_KEY)
        client = client_key(_bearer_token(request), request.client.host if request.client else None)
        return Caller(request_id, user or "", client)

    async def authenticated(request: Request) -> None:
        if token_check is not None and not token_check(_bearer_token(request)):
            raise Unauthenticated("a valid bearer token is required (Authorization: Bearer <token>)")

    @app.exception_handler(Unauthenticated)
    async def unauthenticated(request: Request, exc: Unauthenticated) -> JSONResponse:
        api = API_OF_ROUTE.get(request.url.path)
        if api is not None:
            servicer.metrics.rejected(api, caller_of(request), exc, time.monotonic())
        return error_response(exc)

    async def accepted(request: Request, model: type, api: str, to_inputs: Callable) -> tuple:
        """(body as `model`, its caller, the served model's name, `to_inputs(body)`: one input
        per prompt), or the error, counted and logged."""
        started = time.monotonic()
        caller = caller_of(request)
        try:
            body = await parse_body(request, model, limits)
            if body.user is not None:
                check_user(body.user, limits)
                caller = caller_of(request, body.user)
            return body, caller, await served_model(body.model), to_inputs(body)
        except Exception as exc:
            servicer.metrics.rejected(api, caller, exc, started)
            raise

    async def served_model(model: str) -> str:
        info = await servicer.model_info()
        if model != info.model_name:
            raise ModelNotFound(f"the model {model!r} does not exist; this server serves {info.model_name!r}")
        return info.model_name

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: probes that read only the status
    async def health() -> Response:
        return Response(status_code=200 if is_serving() else 503)

    # HEAD wherever GET (RFC 9110; load balancers probe with it): the GET's status and headers.
    @app.api_route("/v1/models", methods=["GET", "HEAD"], dependencies=[Depends(authenticated)])
    @_answers_errors
    async def models() -> dict:
        return {"object": "list", "data": [model_card(await servicer.model_info())]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authenticated)])
    @_answers_errors
    async def chat_completions(request: Request) -> Response:
        body, caller, model, prompts = await accepted(
            request, ChatCompletionRequest, API_CHAT, lambda b: [chat_input(b, max_choices)])
        inputs = with_choice_seeds(prompts, body.n)
        streams = ChoiceStreams(lambda r, sink: servicer.generate(r, None, API_CHAT, caller, body.stream, sink),
                                inputs)
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
    async def completions(request: Request) -> Response:
        body, caller, model, prompts = await accepted(
            request, CompletionRequest, API_COMPLETIONS, lambda b: completion_inputs(b, max_choices))
        inputs = with_choice_seeds(prompts, body.n)
        echoed = [await _prompt_text(servicer, r) for r in inputs] if body.echo else [""] * len(inputs)
        streams = ChoiceStreams(lambda r, sink: servicer.generate(r, None, API_COMPLETIONS, caller, sink=sink),
                                inputs)
        header = bodies.ResponseHeader.new("cmpl", bodies.COMPLETION_OBJECT, model)
        if body.stream:
            return await _event_stream(streams, _completion_events(header, body, echoed, len(prompts)))
        outputs = await _collect(streams, len(inputs), request)
        with_logprobs = body.logprobs is not None
        return JSONResponse(header.body(
            choices=[
                bodies.completion_choice(i, echoed[i] + "".join(out.text), out.logprobs if with_logprobs else None,
                                         out.finish_reason)
                for i, out in enumerate(outputs)
            ],
            usage=bodies.usage_body([out.usage for out in outputs], len(prompts)),
        ))

    add_text_routes(app, servicer, authenticated, _answers_errors, limits)
    add_embedding_routes(app, servicer, authenticated, _answers_errors, limits, caller_of)

    return app


def _bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    return (header[len(BEARER):].strip() or None) if header.lower().startswith(BEARER) else None


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


# An event formatter turns (index, chunk) into SSE events; None marks the end of all choices.
Events = Callable[[int | None, generation_pb2.GenerateResponse | None], list[bytes]]


async def _event_stream(streams: ChoiceStreams, events: Events) -> Response:
    """A server-sent-event response, or an error response when the first chunk fails."""
    chunks = streams.__aiter__()
    try:
        first = await anext(chunks, None)
    except Exception as exc:
        await streams.aclose()
        return error_response(exc)

    async def stream() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                for event in events(*first):
                    yield event
            try:
                async for index, chunk in chunks:
                    for event in events(index, chunk):
                        yield event
                for event in events(None, None):
                    yield event
            except Exception as exc:  # the status line is sent: report the error in-stream
                yield sse.event(error_body(exc)[1])
            yield sse.DONE
        finally:
            await streams.aclose()

    return StreamingResponse(stream(), media_type=sse.MEDIA_TYPE,
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


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
    chunks = sse.ChunkEvents(header, body.include_usage)

    def events(index: int | None, chunk: generation_pb2.GenerateResponse | None) -> list[bytes]:
        if index is None:
            return [sse.event(header.body(choices=[], usage=totals.body(1)))] if body.include_usage else []
        totals.add(index, chunk)
        if index in started:
            if (chunk.text and not chunk.finish_reason and not body.logprobs and not chunk.reasoning_text
                    and not chunk.tool_calls):
                return [chunks.content(index, chunk.text)]  # a step's text, as most are
            return [chunks.chunk([bodies.chat_delta(index, chunk, body.logprobs, False)])]
        started.add(index)
        return [chunks.chunk([bodies.chat_delta(index, chunk, body.logprobs, True)])]

    return events


async def _prompt_text(servicer: GenerationServicer, request: generation_pb2.GenerateRequest) -> str:
    """What `echo` puts before a completion: the prompt, as text."""
    return request.prompt or await servicer.detokenize(request.prompt_token_ids)


def _completion_events(header: bodies.ResponseHeader, body: CompletionRequest,
                       echoed: Sequence[str], num_prompts: int) -> Events:
    """`echoed[i]`: the text choice i starts with (its prompt with `echo`, else empty)."""
    offsets = [0] * len(echoed)
    totals = _UsageTotals(len(echoed))
    unsent = dict(enumerate(echoed))
    chunks = sse.ChunkEvents(header, body.include_usage)
    with_logprobs = body.logprobs is not None

    def events(index: int | None, chunk: generation_pb2.GenerateResponse | None) -> list[bytes]:
        if index is None:
            return [sse.event(header.body(choices=[], usage=totals.body(num_prompts)))] if body.include_usage else []
        totals.add(index, chunk)
        text = (unsent.pop(index, "") + chunk.text) if unsent else chunk.text
        offset = offsets[index]
        offsets[index] = offset + len(text)
        if not with_logprobs and not chunk.finish_reason:
            return [chunks.text(index, text)]  # a step's text, as most are
        choice = bodies.completion_choice(index, text, chunk.logprobs if with_logprobs else None,
                                          chunk.finish_reason, offset)
        return [chunks.chunk([choice])]

    return events
