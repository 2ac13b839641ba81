"""Several choices of one request, run concurrently and read as one stream.

All choices of a prompt carry the same token ids, so the gateway sends them to the same router
(prompt affinity) and the router's radix cache computes the prompt once: the first choice to
prefill writes the pages, the others match them (or wait for them while they are written).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

from gateway_service.mailbox import Mailbox
from gateway_service.plain_lane import Sink
from radixserve.sampling import SEED_MASK
from radixserve.v1 import generation_pb2

GenerateRequest = generation_pb2.GenerateRequest
Chunk = generation_pb2.GenerateResponse


def with_choice_seeds(inputs: Sequence[GenerateRequest], n: int) -> list[GenerateRequest]:
    """Each input repeated `n` times, in order; choice j of a seeded request samples with
    seed + j, so that choices differ from each other yet the response is reproducible."""
    out = []
    for request in inputs:
        seeded = request.sampling.HasField("seed")
        for j in range(n):
            if not seeded or j == 0:
                out.append(request)
            else:
                choice = GenerateRequest()
                choice.CopyFrom(request)
                choice.sampling.seed = (request.sampling.seed + j) & SEED_MASK
                out.append(choice)
    return out


class ChoiceStreams:
    """`(index, chunk)` pairs from every choice, in arrival order.

    Each choice runs as its own task (the one the servicer's drain cancels) feeding one
    mailbox, which the reader empties at each wake-up. The first failure of any choice is
    raised to the reader; `aclose` (also on the reader's cancellation) cancels every choice,
    which cancels their router calls.
    """

    def __init__(self, start: Callable[[GenerateRequest, Sink], AsyncIterator[Chunk]],
                 inputs: Sequence[GenerateRequest]) -> None:
        """`start(request, sink)`: a choice's chunks; it may also hand chunks to `sink` directly,
        in order with the stream's (plain_lane.py)."""
        self._mailbox: Mailbox[tuple[int, Chunk | None, BaseException | None]] = Mailbox()
        self._tasks = [
            asyncio.create_task(self._pump(index, start(request, self._sink(index))))
            for index, request in enumerate(inputs)
        ]
        self._num_running = len(self._tasks)

    def _sink(self, index: int) -> Sink:
        put = self._mailbox.put

        def sink(chunk: Chunk) -> None:
            put((index, chunk, None))
        return sink

    async def _pump(self, index: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async with contextlib.aclosing(stream) as chunks:
                async for chunk in chunks:
                    self._mailbox.put((index, chunk, None))
        except Exception as exc:
            self._mailbox.put((index, None, exc))
        else:
            self._mailbox.put((index, None, None))

    async def __aiter__(self) -> AsyncIterator[tuple[int, Chunk]]:
        while self._num_running:
            for index, chunk, error in await self._mailbox.take():
                if error is not None:
                    raise error
                if chunk is None:
                    self._num_running -= 1
                    continue
                yield index, chunk

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
