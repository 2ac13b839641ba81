"""The asyncio client of the gateway's GenerationService (same API as `Client`, awaited)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import grpc

from radixserve_client.connection import DEFAULT_ADDRESS, Endpoint
from radixserve_client.errors import RadixServeError, from_rpc_error
from radixserve_client.many import DEFAULT_WINDOW, ManyRequests
from radixserve_client.request import Message, chat_messages, embed_request, generate_request
from radixserve_client.results import Chunk, GenerateResult, ModelInfo, chunk_from_proto, join_chunks
from radixserve_client.shared_call import SharedCalls, check_window
from radixserve.v1 import generation_pb2


class AsyncClient(Endpoint):
    """`async with AsyncClient(address) as c: result = await c.generate(prompt="Hi")`.

    Cancelling the awaiting task, or leaving an `async for` over `stream` early, cancels
    the request on the server. TLS and token options are those of `Client`.

    With `multiplex=True`, `stream` and `generate` carry their requests on shared GenerateMany
    calls (at most `window` requests open on one; shared_call.py) instead of a Generate call
    each: the same results and errors, at a fraction of the gRPC messages on both ends when
    many requests run at once. Without it, each request is its own Generate call.
    """

    asynchronous = True

    def __init__(self, address: str = DEFAULT_ADDRESS, *, multiplex: bool = False, window: int | None = None,
                 **connection: Any) -> None:
        window = check_window(multiplex, window)
        super().__init__(address, **connection)
        self._shared = SharedCalls(self._stub, self._metadata, window) if multiplex else None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._shared is not None:
            await self._shared.close()
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
        if self._shared is not None:
            async with contextlib.aclosing(self._shared.stream(request, timeout)) as responses:
                async for response in responses:
                    yield chunk_from_proto(response)
            return
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

    async def generate_many(
        self, requests: Iterable[Mapping[str, Any]], *, timeout: float | None = None,
        window: int = DEFAULT_WINDOW, return_exceptions: bool = False,
    ) -> list[GenerateResult | RadixServeError]:
        """See `Client.generate_many`."""
        state = ManyRequests(requests, window)
        outgoing: asyncio.Queue[generation_pb2.ManyRequest | None] = asyncio.Queue()

        async def messages() -> AsyncIterator[generation_pb2.ManyRequest]:
            while (message := await outgoing.get()) is not None:
                yield message

        call = self._stub.GenerateMany(messages(), timeout=timeout, metadata=self._metadata)
        try:
            for message in state.to_send():
                outgoing.put_nowait(message)
            async for reply in call:
                state.take(reply)
                for message in state.to_send():
                    outgoing.put_nowait(message)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()
        return state.outcome(return_exceptions)

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
