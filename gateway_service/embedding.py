"""Embed: each input tokenized, sent to a router as a prefill-only request, the vectors gathered.

Inputs are embedded independently and concurrently: each is its own router request, chosen by
its prefix like a generation (same prefix, same replica, warm cache), so the router batches them
with each other and with generation traffic. A router that is UNAVAILABLE before answering is
failed over as for Generate. Every input is checked before any is sent: a bad one refuses the
whole request (INVALID_ARGUMENT naming `inputs[i]`), so nothing is computed for nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from gateway_service.errors import InvalidRequest, NoRouterAvailable
from gateway_service.pooling_config import PoolingConfig
from gateway_service.router_choice import RouterPool
from gateway_service.text_pool import TextPool
from gateway_service.tokenizer import Tokenizer
from gateway_service.validation import RequestLimits, check_prompt_token_ids, check_request_id
from radixserve.v1 import generation_pb2, router_pb2

log = logging.getLogger(__name__)


class Embedder:
    def __init__(self, pool: RouterPool, limits: RequestLimits, text: TextPool, max_inputs: int) -> None:
        self._pool = pool
        self._limits = limits
        self._text = text
        self._max_inputs = max_inputs

    async def embed(
        self, request: generation_pb2.EmbedRequest, info: router_pb2.GetServerInfoResponse,
        tokenizer: Tokenizer, pooling: PoolingConfig, request_id: str, deadline: float | None,
    ) -> generation_pb2.EmbedResponse:
        """The request's vectors, in input order (`deadline` on `time.monotonic()`)."""
        if pooling.problem is not None:
            raise InvalidRequest(f"this model does not serve embeddings: {pooling.problem}")
        check_request_id(request.request_id, self._limits)
        if not 1 <= len(request.inputs) <= self._max_inputs:
            raise InvalidRequest(f"inputs: give 1 to {self._max_inputs} inputs, got {len(request.inputs)}")
        if request.HasField("dimensions") and request.dimensions != pooling.dimensions:
            raise InvalidRequest(f"dimensions: this model's embeddings have {pooling.dimensions} dimensions; "
                                 f"other sizes (got {request.dimensions}) are not supported")
        num_chars = sum(len(item.text) for item in request.inputs)
        if num_chars > self._limits.max_prompt_chars:
            raise InvalidRequest(f"inputs: {num_chars} characters, more than the limit of "
                                 f"{self._limits.max_prompt_chars}")
        prompts = await self._text.encode(_encode, tokenizer, request.inputs)
        limit = min(self._limits.max_prompt_tokens or info.model.context_len, info.model.context_len - 1)
        vocab_size = info.vocab_size or tokenizer.vocab_size
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise InvalidRequest(f"inputs[{index}] is empty")
            if len(prompt) > limit:
                raise InvalidRequest(f"inputs[{index}] has {len(prompt)} tokens, more than the limit of {limit}")
            check_prompt_token_ids(prompt, vocab_size, f"inputs[{index}]")
        routed = [
            router_pb2.RouterEmbedRequest(request_id=f"{request_id}-{uuid.uuid4().hex[:12]}-{index}",
                                          prompt_token_ids=prompt, pooling=pooling.pooling)
            for index, prompt in enumerate(prompts)
        ]
        tasks = [asyncio.ensure_future(self._route(one, deadline)) for one in routed]
        try:
            answers = await asyncio.gather(*tasks)
        except BaseException:  # one failed or the caller left: the others' router calls end too
            for task in tasks:
                task.cancel()
            raise
        response = generation_pb2.EmbedResponse()
        for answer in answers:
            response.embeddings.add(values=answer.embedding)
            response.usage.prompt_tokens += answer.usage.prompt_tokens
            response.usage.cached_tokens += answer.usage.cached_tokens
        return response

    async def _route(self, request: router_pb2.RouterEmbedRequest, deadline: float | None) -> router_pb2.RouterEmbedResponse:
        """One input's vector, failing over to the next router in rendezvous order when one is
        UNAVAILABLE (an embedding has no partial answer: any router may retry it)."""
        failures = []
        for address in self._pool.order(request.prompt_token_ids):
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                return await self._pool.stub(address).Embed(request, timeout=timeout,
                                                             metadata=self._pool.call_metadata)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                self._pool.mark_down(address)
                failures.append(f"{address}: {exc.details() or exc.code().name}")
        log.warning("embedding %s: no router could take it (%s)", request.request_id, "; ".join(failures))
        raise NoRouterAvailable("no router could take the request")


def _encode(tokenizer: Tokenizer, inputs) -> list[list[int]]:
    """Texts with the tokenizer's own special tokens (as sentence-transformers encodes them);
    token ids as given."""
    return [list(item.tokens.token_ids) if item.HasField("tokens") else tokenizer.encode_prompt(item.text)
            for item in inputs]
