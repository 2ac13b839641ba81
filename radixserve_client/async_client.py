"""The asyncio client of the gateway's GenerationService (same API as `Client`, awaited)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import grpc

from radixserve_client.connection import Endpoint
from radixserve_client.errors import from_rpc_error
from radixserve_client.request import Message, chat_messages, embed_request, generate_request
from radixserve_client.results import Chunk, GenerateResult, ModelInfo, chunk_from_proto, join_chunks
from radixserve.v1 import generation_pb2


class AsyncClient(Endpoint):
    """`async with AsyncClient(address) as c: result = await c.generate(prompt="Hi")`.

    Cancelling the awaiting task, or leaving an `async for` over `stream` early, cancels
    the request on the server. TLS and token options are those of `Client`.
    """

    asynchronous = True

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def stream(
        self,
        prompt: str | None = None,
        messages: Iterable[Message] | None = None,
        *,
        timeout: float | None = None,
        **options: Any,
    ) -> AsyncIterator[Chunk]:
        request = generate_request(prompt, messages, **options)
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            async for response in call:
                yield chunk_from_proto(response)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()

    async def generate(
        self,
        prompt: str | None = None,
        messages: Iterable[Message] | None = None,
        *,
        timeout: float | None = None,
        **options: Any,
    ) -> GenerateResult:
        return join_chunks([chunk async for chunk in self.stream(prompt, messages, timeout=timeout, **options)])

    async def tokenize(
        self, prompt: str | None = None, messages: Iterable[Message] | None = None,
        *, timeout: float | None = None,
    ) -> list[int]:
        request = generation_pb2.TokenizeRequest(
            prompt=prompt or "", messages=chat_messages(messages or ())
        )
        try:
            reply = await self._stub.Tokenize(request, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        return list(reply.token_ids)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        try:
            return await self._stub.GetModelInfo(
                generation_pb2.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def embed(
        self, inputs: str | Sequence[int] | Sequence[str | Sequence[int]], *,
        dimensions: int | None = None, timeout: float | None = None,
    ) -> list[list[float]]:
        """The embedding of each input (a text, a list of token ids, or a list of either), in order,
        pooled as the served model's folder says (docs/agent-api.md)."""
        try:
            reply = await self._stub.Embed(embed_request(inputs, dimensions), timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        return [list(item.values) for item in reply.embeddings]
