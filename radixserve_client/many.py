"""`generate_many`: many requests on one GenerateMany call (both clients share this bookkeeping).

Each request gets its index as its id; at most `window` are open at once (the gateway refuses
more than its --max-requests-per-call), and the next starts as one ends. A request's updates
are joined as a Generate stream's chunks are; one that failed becomes its typed error.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from radixserve_client.errors import RadixServeError, from_status
from radixserve_client.request import generate_request
from radixserve_client.results import Chunk, GenerateResult, chunk_from_proto, join_chunks
from radixserve.v1 import generation_pb2

# Requests open at once on one call: under the gateway's default --max-requests-per-call.
DEFAULT_WINDOW = 256


class ManyRequests:
    """The requests to send, in order, and what has come back for each."""

    def __init__(self, requests: Iterable[Mapping[str, Any]], window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self._pending: Iterator[generation_pb2.GenerateRequest] = (
            generate_request(**dict(options)) for options in requests)
        self._window = window
        self._chunks: list[list[Chunk]] = []
        self.results: list[GenerateResult | RadixServeError | None] = []
        self.open = 0

    def to_send(self) -> list[generation_pb2.ManyRequest | None]:
        """What to send now: new requests up to the window, then None (the end of the caller's
        stream) once every request has ended."""
        messages: list[generation_pb2.ManyRequest | None] = []
        while self.open < self._window:
            request = next(self._pending, None)
            if request is None:
                break
            messages.append(generation_pb2.ManyRequest(id=len(self.results), generate=request))
            self._chunks.append([])
            self.results.append(None)
            self.open += 1
        if self.open == 0:
            messages.append(None)
        return messages

    def take(self, message: generation_pb2.ManyResponse) -> None:
        for update in message.updates:
            index = update.id
            if update.code:
                self.results[index] = from_status(update.code, update.message)
                self._chunks[index] = []
                self.open -= 1
                continue
            chunk = chunk_from_proto(update.response)
            self._chunks[index].append(chunk)
            if chunk.finish_reason is not None:
                self.results[index] = join_chunks(self._chunks[index])
                self._chunks[index] = []
                self.open -= 1

    def outcome(self, return_exceptions: bool) -> list[GenerateResult | RadixServeError]:
        """The results in order; raises the first failure unless `return_exceptions`."""
        missing = [i for i, result in enumerate(self.results) if result is None]
        if missing:
            raise RadixServeError(f"the call ended without a result for requests {missing[:8]}")
        if not return_exceptions:
            for result in self.results:
                if isinstance(result, RadixServeError):
                    raise result
        return list(self.results)
