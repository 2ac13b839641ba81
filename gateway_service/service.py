"""The GenerationService servicer: validate, tokenize, stream from a router, assemble text.

Requests and responses are the public messages themselves (the HTTP API builds and reads the
same ones); the router is asked with its own `RouterGenerateRequest`. Every failure becomes a
status in `errors.to_status`. A request's router call lives exactly as long as the client's stream:
it is cancelled when the client cancels, when a stop string ends the output, or on error.

Drain (`stop` of the gateway): `draining` refuses new calls; `end_streams` ends every call still
in flight with `ShuttingDown` (gRPC UNAVAILABLE; the HTTP API's error event and `[DONE]`), so
both APIs end within one grace period.
"""

from __future__ import annotations

import asyncio

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable

import grpc

from gateway_service.caller import REQUEST_ID_HEADER, Caller, grpc_caller
from gateway_service.chat_format import (ChatFormat, ChatPlan, check_chat_only, check_history,
                                         check_tools, plan_chat, template_kwargs)
from gateway_service.chat_output import output_splitter
from gateway_service.chat_render import template_input
from gateway_service.config import GatewayConfig
from gateway_service.constraint_check import ConstraintChecker
from gateway_service.embedding import Embedder
from gateway_service.errors import GatewayError, InvalidRequest, NoRouterAvailable, ShuttingDown, to_status
from gateway_service.generate_call import mailbox_chunks
from gateway_service.known_fields import check_known_fields
from gateway_service.many_call import ManyCall, request_caller
from gateway_service.metrics import API_EMBED, API_GRPC, API_GRPC_MANY, GatewayMetrics
from gateway_service.output import OutputAssembler
from gateway_service.plain_lane import Sink, plain_lane
from gateway_service.pooling_config import PoolingConfig
from gateway_service.reasoning_constraint import checked_constraint
from gateway_service.router_choice import RouterPool
from gateway_service.router_stream import BareTokens
from gateway_service.text_pool import TextPool
from gateway_service.tokenizer import Tokenizer
from gateway_service.validation import (
    check_input,
    check_prompt_token_ids,
    check_prompt_tokens,
    check_text_input,
    resolve_max_tokens,
    resolve_sampling,
)
from radixserve import constraints, sampling
from radixserve.v1 import generation_pb2, generation_pb2_grpc, router_pb2

log = logging.getLogger(__name__)
ENDED_BY_DRAIN = "the gateway shut down before the request finished; retry it"


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, config: GatewayConfig, pool: RouterPool) -> None:
        self._config = config
        self._limits = config.limits
        self._pool = pool
        self.metrics = GatewayMetrics(lambda: pool.info.model.model_name if pool.info else "")
        self._text = TextPool(config.tokenizer_threads)
        # Set once the tokenizer is loaded (the server answers NOT_SERVING until then).
        self.tokenizer: Tokenizer | None = None
        # Set with the tokenizer; compiles constraints to check them.
        self.constraints: ConstraintChecker | None = None
        # Set with the tokenizer: the tool-call and reasoning formats of its chat template.
        self.chat: ChatFormat | None = None
        # Set with the tokenizer: how the model pools an embedding (its folder's config).
        self.pooling: PoolingConfig | None = None
        self._embedder = Embedder(pool, config.limits, self._text, config.max_embed_inputs)
        # Set when the gateway starts to drain (`draining`): calls that arrive from then on are
        # refused here with UNAVAILABLE while the servers still accept (see `wait_idle`).
        self._draining = False
        # Open GenerateMany calls, told when the drain begins.
        self._many_calls: set[ManyCall] = set()
        # Generate calls (both APIs) between admission and their last chunk, each by its task
        # and whether its caller holds a chunk (True) or it waits on its router; `_idle` is set
        # while there are none.
        self._in_flight: dict[asyncio.Task, bool] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        # Set by `end_streams`: the calls cancelled from then on end with ShuttingDown.
        self._ending = False

    # --- RPCs -----------------------------------------------------------------------------

    async def Generate(self, request, context) -> AsyncIterator[generation_pb2.GenerateResponse]:
        # Cancellation (asyncio.CancelledError) is not an Exception: it passes through and
        # cancels the router call on its way out.
        try:
            caller = self._grpc_caller(request, context)
            await context.send_initial_metadata(((REQUEST_ID_HEADER, caller.request_id),))
            remaining = context.time_remaining()
            deadline = None if remaining is None else time.monotonic() + remaining
            # The request runs as its own task, so that its plain tokens take the lane (generate_call.py).
            async with contextlib.aclosing(mailbox_chunks(
                    lambda r, sink: self.generate(r, deadline, API_GRPC, caller, sink=sink), request)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except Exception as exc:
            await context.abort(*to_status(exc))

    async def GenerateMany(self, requests, context) -> AsyncIterator[generation_pb2.ManyResponse]:
        """Many requests on one call (many_call.py); the call's deadline bounds each of them."""
        try:
            self._refuse_if_draining()
            call_caller = self._grpc_caller(generation_pb2.GenerateRequest(), context)
            await context.send_initial_metadata(((REQUEST_ID_HEADER, call_caller.request_id),))
            remaining = context.time_remaining()
            deadline = None if remaining is None else time.monotonic() + remaining
            max_id_len = self._limits.max_request_id_len
            call = ManyCall(lambda request, caller, sink: self.generate(request, deadline, API_GRPC_MANY, caller,
                                                                      sink=sink),
                            lambda request, index: request_caller(call_caller, request, index, max_id_len),
                            self._config.max_requests_per_call, lambda: self._draining)
            self._many_calls.add(call)
            try:
                async for message in call.responses(requests):
                    yield message
            finally:
                self._many_calls.discard(call)
        except Exception as exc:
            await context.abort(*to_status(exc))

    async def Tokenize(self, request, context) -> generation_pb2.TokenizeResponse:
        try:
            return await self.tokenize(request)
        except Exception as exc:
            await context.abort(*to_status(exc))

    async def tokenize(self, request: generation_pb2.TokenizeRequest) -> generation_pb2.TokenizeResponse:
        """The token ids of a prompt or a chat (both APIs)."""
        self._refuse_if_draining()
        check_known_fields(request)
        check_text_input(request, self._limits)
        check_tools(request.tools, self._limits.max_prompt_chars)
        check_history(request.messages, self._limits.max_prompt_chars)
        check_chat_only(request)
        token_ids = await self._text.encode(self._encode_tokenize, request)
        info = self._pool.info  # without a router yet, the character limit bounds the cost
        check_prompt_tokens(len(token_ids), info.model.context_len if info else None, self._limits)
        return generation_pb2.TokenizeResponse(token_ids=token_ids)

    async def Detokenize(self, request, context) -> generation_pb2.DetokenizeResponse:
        try:
            check_known_fields(request)
            return generation_pb2.DetokenizeResponse(text=await self.detokenize(request.token_ids))
        except Exception as exc:
            await context.abort(*to_status(exc))

    async def detokenize(self, token_ids) -> str:
        """Token ids (each in the vocabulary, at most the prompt limit of them) as text."""
        self._refuse_if_draining()
        tokenizer = self._require_tokenizer()
        info = self._pool.info
        check_prompt_tokens(len(token_ids), info.model.context_len if info else None, self._limits,
                            "token_ids")
        check_prompt_token_ids(token_ids, (info.vocab_size if info else 0) or tokenizer.vocab_size, "token_ids")
        return await self._text.decode(tokenizer.decode_all, token_ids)

    async def Embed(self, request, context) -> generation_pb2.EmbedResponse:
        try:
            check_known_fields(request)
            caller = self._grpc_caller(request, context)
            remaining = context.time_remaining()
            deadline = None if remaining is None else time.monotonic() + remaining
            return await self.embed(request, caller, deadline, API_EMBED)
        except Exception as exc:
            await context.abort(*to_status(exc))

    def embed(self, request: generation_pb2.EmbedRequest, caller: Caller, deadline: float | None,
              api: str) -> Awaitable[generation_pb2.EmbedResponse]:
        """The inputs' embeddings (both APIs; see embedding.py), measured and logged."""
        return self.metrics.observe_embedding(api, caller, self._embed(request, caller, deadline))

    async def _embed(self, request: generation_pb2.EmbedRequest, caller: Caller,
                     deadline: float | None) -> generation_pb2.EmbedResponse:
        self._refuse_if_draining()
        info = await self._server_info()
        tokenizer = self._require_tokenizer()
        if self.pooling is None:
            raise GatewayError("the gateway is still loading its tokenizer", grpc.StatusCode.UNAVAILABLE)
        return await self._embedder.embed(request, info, tokenizer, self.pooling, caller.request_id, deadline)

    async def GetModelInfo(self, request, context) -> generation_pb2.GetModelInfoResponse:
        try:
            check_known_fields(request)
            return await self.model_info()
        except Exception as exc:
            await context.abort(*to_status(exc))

    # --- Generate ---------------------------------------------------------------------------

    def generate(
        self, request: generation_pb2.GenerateRequest, deadline: float | None, api: str, caller: Caller,
        incremental_calls: bool = True, sink: Sink | None = None,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """One request's output, validated, measured and logged; `deadline` is on `time.monotonic()`.

        Every API (gRPC, the HTTP API's `api` routes) comes through here; errors are raised
        as they are and become a status in `errors.to_status`. `incremental_calls`: tool calls
        stream as they are generated; False (an answer read whole) reports each call once, at
        the end, and an output whose calls do not parse as content (see chat_output.py). `sink`:
        where the caller also takes chunks given to it directly, in order with the stream's
        (plain_lane.py).
        """
        observation = self.metrics.observation(api, caller)
        observed = None if sink is None else observation.observed(sink)
        return observation.observe(self._generate(request, deadline, caller, incremental_calls, observed))

    async def model_info(self) -> generation_pb2.GetModelInfoResponse:
        """The model the routers serve; raises `NoRouterAvailable` while none answers."""
        return (await self._server_info()).model

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        if value:
            for call in self._many_calls:
                call.wake()  # a call with nothing open ends now

    async def wait_idle(self) -> None:
        """Returns once no Generate call is in flight (drain waits on this before the servers
        stop, so callers arriving meanwhile get this servicer's UNAVAILABLE, not CANCELLED)."""
        await self._idle.wait()

    def end_streams(self) -> None:
        """End every Generate call in flight with `ShuttingDown` (the end of the drain's grace):
        at once where it waits on its router; where its caller holds a chunk (a gRPC handler
        while grpc writes it), when the caller asks for the next one. Cancelling that caller's
        task would end the call as CANCELLED, and only once the server stops."""
        self._ending = True
        for task, with_caller in self._in_flight.items():
            if not with_caller:
                task.cancel()

    async def _generate(
        self, request: generation_pb2.GenerateRequest, deadline: float | None, caller: Caller,
        incremental_calls: bool, sink: Sink | None,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self._refuse_if_draining()
        # Each request runs in its own task (a Generate call's, generate_call.py; one per HTTP
        # choice; one per GenerateMany request), which `end_streams` cancels.
        task = asyncio.current_task()
        in_flight = self._in_flight
        in_flight[task] = False
        self._idle.clear()
        try:
            async with contextlib.aclosing(self._generate_admitted(request, deadline, caller, incremental_calls,
                                                                   sink)) as chunks:
                async for chunk in chunks:
                    in_flight[task] = True
                    yield chunk
                    in_flight[task] = False
                    if self._ending:
                        raise ShuttingDown(ENDED_BY_DRAIN)
        except asyncio.CancelledError:
            if not self._ending:
                raise
            task.uncancel()
            raise ShuttingDown(ENDED_BY_DRAIN) from None
        finally:
            in_flight.pop(task, None)
            if not in_flight:
                self._idle.set()

    async def _generate_admitted(
        self, request: generation_pb2.GenerateRequest, deadline: float | None, caller: Caller,
        incremental_calls: bool, sink: Sink | None,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        info = await self._server_info()
        tokenizer = self._require_tokenizer()
        vocab_size = info.vocab_size or tokenizer.vocab_size
        check_input(request, vocab_size, self._limits)
        params = resolve_sampling(request.sampling, vocab_size, request.logprobs, request.top_logprobs)
        plan = plan_chat(request, self._require_chat(), self._limits.max_prompt_chars)
        prompt_ids = await self._text.encode(self._encode_generate, request, plan)
        # The context length is checked next, with a message that names max_tokens too.
        check_prompt_tokens(len(prompt_ids), None, self._limits)
        max_tokens = resolve_max_tokens(
            request.max_tokens if request.HasField("max_tokens") else None, len(prompt_ids),
            info.model.context_len, self._config.default_max_tokens,
        )
        constraint = await checked_constraint(request, plan, self._require_chat(), self._require_constraints,
                                              prompt_ids, tokenizer, caller.client)
        # The router sees a unique id even when callers reuse theirs, or when the choices of one
        # HTTP request share it; logs keep the caller's.
        request_id = f"{caller.request_id}-{uuid.uuid4().hex[:12]}"
        routed = router_pb2.RouterGenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            max_tokens=max_tokens,
            sampling=sampling.to_proto(params),
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            constraint=constraints.to_proto(constraint),
        )
        assembler = OutputAssembler(tokenizer, request.stop, len(prompt_ids))
        splitter = output_splitter(plan, prompt_ids, tokenizer, self._require_chat(), incremental_calls)
        log.debug("request %s: %d prompt tokens, max_tokens %d", request_id, len(prompt_ids), max_tokens)
        lane = None if sink is None else plain_lane(assembler, splitter, sink)
        async with contextlib.aclosing(self._pool.generate_failing_over(routed, deadline, lane)) as stream:
            async for response in stream:
                if type(response) is BareTokens:  # plain tokens: usage, drafts, finish as they were
                    add, args = assembler.add_plain, (response.token_ids,)
                else:
                    usage = response.usage
                    add, args = assembler.add, (response.token_ids, response.logprobs, response.finish_reason,
                                                usage.cached_tokens, (usage.draft_tokens, usage.accepted_draft_tokens))
                # A decode step's token is detokenized here: a thread hand-off would cost more.
                if assembler.is_cheap(*args[:2]):
                    chunk = add(*args)
                else:
                    chunk = await self._text.decode(add, *args)
                if chunk is not None:
                    if splitter is not None:
                        splitter.apply(chunk)
                    yield chunk
                if assembler.finished:
                    return  # leaving `aclosing` cancels the router call (stop strings)
        raise GatewayError("the router's stream ended without a finish reason")

    # --- helpers ----------------------------------------------------------------------------


    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise GatewayError("the gateway is still loading its tokenizer", grpc.StatusCode.UNAVAILABLE)
        return self.tokenizer

    def _require_constraints(self) -> ConstraintChecker:
        if self.constraints is None:
            raise GatewayError("the gateway is still loading its tokenizer", grpc.StatusCode.UNAVAILABLE)
        return self.constraints

    def _require_chat(self) -> ChatFormat:
        if self.chat is None:
            raise GatewayError("the gateway is still loading its tokenizer", grpc.StatusCode.UNAVAILABLE)
        return self.chat

    def _encode_generate(self, request: generation_pb2.GenerateRequest, plan: ChatPlan) -> list[int]:
        if request.prompt_token_ids:
            return list(request.prompt_token_ids)
        if request.messages:
            return self._encode_chat(request.messages, plan.tools, plan.template_kwargs, True)
        return self._require_tokenizer().encode_prompt(request.prompt)

    def _encode_tokenize(self, request: generation_pb2.TokenizeRequest) -> list[int]:
        if request.messages:
            add_generation_prompt = not request.HasField("add_generation_prompt") or request.add_generation_prompt
            return self._encode_chat(request.messages, request.tools,
                                     template_kwargs(request.chat_template_kwargs, self._require_chat().template_reads),
                                     add_generation_prompt, request.add_special_tokens)
        add_special_tokens = not request.HasField("add_special_tokens") or request.add_special_tokens
        return self._require_tokenizer().encode_prompt(request.prompt, add_special_tokens)

    def _encode_chat(self, turns, tools, kwargs: dict, add_generation_prompt: bool,
                     add_special_tokens: bool = False) -> list[int]:
        """The rendered template holds its special tokens: `add_special_tokens` adds the
        tokenizer's own once more (what vLLM's /tokenize does when asked)."""
        tokenizer, chat = self._require_tokenizer(), self._require_chat()
        messages, tool_defs = template_input(turns, tools, chat.renders_tools, chat.tool_parser)
        text = tokenizer.apply_template(messages, tool_defs, kwargs, add_generation_prompt)
        return tokenizer.encode_prompt(text) if add_special_tokens else tokenizer.encode_rendered(text)

    def _grpc_caller(self, request: generation_pb2.GenerateRequest, context) -> Caller:
        return grpc_caller(request.request_id, context, self._limits.max_request_id_len)

    def _refuse_if_draining(self) -> None:
        if self._draining:
            raise ShuttingDown("the gateway is shutting down; retry on another replica")

    def close(self) -> None:
        self._text.close()

    async def _server_info(self) -> router_pb2.GetServerInfoResponse:
        info = self._pool.info
        if info is None:
            await self._pool.probe_all()
            info = self._pool.info
        if info is None:
            raise NoRouterAvailable("no router has answered GetServerInfo yet")
        return info
