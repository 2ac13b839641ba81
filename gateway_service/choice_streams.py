"""Requests run as tasks of their own and read as one stream: the choices of an HTTP request
(openai_api/app.py), a Generate call's one request (generate_call.py).

Each request's task feeds one mailbox, by its stream or by the sink its plain tokens take
(plain_lane.py), and the reader empties the mailbox at each wake-up; the drain cancels the
tasks as it cancels any request's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

from gateway_service.mailbox import Mailbox
from gateway_service.plain_lane import Sink
from radixserve.v1 import generation_pb2

GenerateRequest = generation_pb2.GenerateRequest
Chunk = generation_pb2.GenerateResponse


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
        async for batch in self.batches():
            for item in batch:
                yield item

    async def batches(self) -> AsyncIterator[list[tuple[int, Chunk]]]:
        """What each wake-up of the reader found: the `(index, chunk)` pairs put since the last,
        in order (a failure is raised after the pairs before it)."""
        while self._num_running:
            batch = []
            for index, chunk, error in await self._mailbox.take():
                if error is not None:
                    if batch:
                        yield batch
                    raise error
                if chunk is None:
                    self._num_running -= 1
                    continue
                batch.append((index, chunk))
            if batch:
                yield batch

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
