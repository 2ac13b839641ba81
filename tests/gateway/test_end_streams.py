"""The end of the drain's grace (`GenerationServicer.end_streams`) for a request whose caller is
busy with its last chunk when it comes, as a gRPC handler is while grpc writes the chunk to a
slow client: the request still ends with `ShuttingDown` (UNAVAILABLE, retry elsewhere) when the
caller asks for the next chunk, not with the caller's own task cancelled (which grpc reports as
CANCELLED, and only once the server stops). A request waiting on its router ends at once.
End to end, SIGTERM on a gateway process: test_drain.py."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from gateway.harness import running_harness
from gateway_service.caller import Caller
from gateway_service.errors import ShuttingDown
from gateway_service.metrics import API_GRPC
from radixserve.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(60)
TOKEN_DELAY_S = 0.02
CALLER_BUSY_S = 0.3


@pytest.mark.parametrize("busy", [True, False], ids=["caller-busy", "waiting-on-router"])
def test_end_streams_ends_a_request_with_shutting_down(tokenizer, busy: bool) -> None:
    with running_harness(tokenizer, num_routers=1) as harness:
        harness.script_all(list(range(1000, 1400)), delay_s=TOKEN_DELAY_S)
        servicer = harness.gateway.servicer

        async def scenario() -> tuple[BaseException | None, int]:
            first = asyncio.Event()
            chunks_after = 0

            async def consume() -> None:
                nonlocal chunks_after
                request = pb.GenerateRequest(prompt="count", max_tokens=400, ignore_eos=True)
                async with contextlib.aclosing(servicer.generate(request, None, API_GRPC, Caller("t"))) as chunks:
                    await anext(chunks)
                    first.set()
                    if busy:
                        await asyncio.sleep(CALLER_BUSY_S)  # the chunk being written to a slow client
                    async for _ in chunks:
                        chunks_after += 1

            task = asyncio.create_task(consume())
            await first.wait()
            if not busy:
                await asyncio.sleep(TOKEN_DELAY_S / 2)  # back to waiting on the router
            servicer.end_streams()
            try:
                await task
            except BaseException as exc:  # noqa: BLE001 - the outcome is the test's subject
                return exc, chunks_after
            return None, chunks_after

        outcome, chunks_after = harness.loop.run(scenario())
    assert isinstance(outcome, ShuttingDown), repr(outcome)
    assert chunks_after == 0
