"""The blocking client of the gateway's GenerationService."""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc

from radixserve_client.connection import DEFAULT_ADDRESS, Endpoint
from radixserve_client.errors import RadixServeError, from_rpc_error
from radixserve_client.many import DEFAULT_WINDOW, ManyRequests
from radixserve_client.request import Message, chat_messages, embed_request, generate_request
from radixserve_client.results import Chunk, GenerateResult, ModelInfo, chunk_from_proto, join_chunks
from radixserve_client.shared_call import check_window
from radixserve_client.shared_call_threads import ThreadSharedCalls
from radixserve.v1 import generation_pb2

__all__ = ["DEFAULT_ADDRESS", "Client"]


class Client(Endpoint):
    """`Client("localhost:50051").generate(prompt="Hello", max_tokens=16).text`.

    Options of `generate` / `stream` are those of `client.request.generate_request`
    (max_tokens, stop, temperature, top_p, ..., logprobs); `timeout` is in seconds.
    Failures raise `RadixServeError` subclasses (`InvalidArgumentError`, `UnavailableError`, ...).

    TLS: `tls=True` (system roots) or `tls_ca="ca.pem"`; `tls_cert/tls_key` for a server that asks
    for a client certificate. `api_token` is sent as `authorization: Bearer ...` on every call.

    With `multiplex=True`, `stream` and `generate` calls made concurrently from many threads share
    GenerateMany calls (at most `window` requests open on one; shared_call_threads.py) instead of
    a Generate call each: the same results and errors, at a fraction of the gRPC messages.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, *, multiplex: bool = False, window: int | None = None,
                 **connection: Any) -> None:
        window = check_window(multiplex, window)
        super().__init__(address, **connection)
        self._shared = ThreadSharedCalls(self._stub, self._metadata, window) if multiplex else None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()
        self._channel.close()

    def stream(
        self,
        prompt: str | None = None,
        messages: Iterable[Message] | None = None,
        *,
        timeout: float | None = None,
        **options: Any,
    ) -> Iterator[Chunk]:
        """Yield chunks as they are generated. Closing the iterator early cancels the request."""
        request = generate_request(prompt, messages, **options)
        if self._shared is not None:
            with contextlib.closing(self._shared.stream(request, timeout)) as responses:
                for response in responses:
                    yield chunk_from_proto(response)
            return
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            for response in call:
                yield chunk_from_proto(response)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()  # no-op when the stream already ended

    def generate(
        self,
        prompt: str | None = None,
        messages: Iterable[Message] | None = None,
        *,
        timeout: float | None = None,
        **options: Any,
    ) -> GenerateResult:
        """The whole completion at once."""
        return join_chunks(list(self.stream(prompt, messages, timeout=timeout, **options)))

    def generate_many(
        self, requests: Iterable[Mapping[str, Any]], *, timeout: float | None = None,
        window: int = DEFAULT_WINDOW, return_exceptions: bool = False,
    ) -> list[GenerateResult | RadixServeError]:
        """Every request (each a mapping of `generate`'s arguments: prompt or messages, and
        options) on one GenerateMany call, at most `window` open at once; the results in order.
        A failed request raises its error once all have ended (or is in the list, with
        `return_exceptions`); `timeout` bounds the whole call."""
        state = ManyRequests(requests, window)
        outgoing: queue.SimpleQueue[generation_pb2.ManyRequest | None] = queue.SimpleQueue()

        for message in state.to_send():
            outgoing.put(message)
        call = self._stub.GenerateMany(iter(outgoing.get, None), timeout=timeout, metadata=self._metadata)
        try:
            for reply in call:
                state.take(reply)
                for message in state.to_send():
                    outgoing.put(message)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()
            outgoing.put(None)  # the request iterator's thread ends
        return state.outcome(return_exceptions)

    def tokenize(
        self, prompt: str | None = None, messages: Iterable[Message] | None = None,
        *, timeout: float | None = None,
    ) -> list[int]:
        request = generation_pb2.TokenizeRequest(
            prompt=prompt or "", messages=chat_messages(messages or ())
        )
        try:
            return list(self._stub.Tokenize(request, timeout=timeout, metadata=self._metadata).token_ids)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        try:
            return self._stub.GetModelInfo(
                generation_pb2.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def embed(
        self, inputs: str | Sequence[int] | Sequence[str | Sequence[int]], *,
        dimensions: int | None = None, timeout: float | None = None,
    ) -> list[list[float]]:
        """The embedding of each input (a text, a list of token ids, or a list of either), in order,
        pooled as the served model's folder says (docs/agent-api.md)."""
        try:
            reply = self._stub.Embed(embed_request(inputs, dimensions), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return [list(item.values) for item in reply.embeddings]
