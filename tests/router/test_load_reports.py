"""The load a router reports on its Stream calls (`RouterStreamResponse.load`): on the first
message before any request, on every message with updates, and alone every load report interval
once the load changed while no request produced a message."""

from __future__ import annotations

import asyncio
import time

import pytest

from radixserve.v1 import router_pb2
from router.harness import generate_request, running_router, settled
from router_service.config import RouterConfig

REPORT_INTERVAL_S = 0.2
NUM_PAGES = 400


@pytest.mark.timeout(60)
def test_stream_messages_carry_the_routers_load() -> None:
    async def scenario() -> None:
        config = RouterConfig(max_batch_tokens=64, max_running_requests=2, load_report_interval_s=REPORT_INTERVAL_S)
        async with running_router([NUM_PAGES], config, step_delay_s=0.01) as h:
            call = h.stub.Stream()
            first = await asyncio.wait_for(call.read(), 5)
            assert not first.updates
            assert (first.load.num_running, first.load.num_waiting) == (0, 0)
            assert first.load.num_pages_total == first.load.num_pages_free > 0
            for i in range(3):  # two run, one waits
                await call.write(router_pb2.RouterStreamRequest(
                    open=generate_request([5 + i] * 20, 400, request_id=f"r{i}")))
            seen_busy = None
            while seen_busy is None:
                message = await asyncio.wait_for(call.read(), 5)
                assert message.HasField("load")
                if message.load.num_running == 2 and message.load.num_waiting == 1:
                    seen_busy = message.load
            assert seen_busy.num_pages_free < seen_busy.num_pages_total
            # A few more steps so that the step time is measured.
            for _ in range(3):
                await asyncio.wait_for(call.read(), 5)
            for i in range(3):
                await call.write(router_pb2.RouterStreamRequest(cancel=f"r{i}"))
            # Cancelled requests send nothing more: the idle load comes alone, within an interval.
            cancelled_at = time.monotonic()
            while True:
                message = await asyncio.wait_for(call.read(), 5)
                if (message.load.num_running, message.load.num_waiting) == (0, 0):
                    break
            assert not message.updates
            assert time.monotonic() - cancelled_at < REPORT_INTERVAL_S + 1.0
            assert message.load.step_time_s > 0
            # Nothing changes any more: no further load-only messages.
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(call.read(), 3 * REPORT_INTERVAL_S)
            await call.done_writing()
            await settled(h)

    asyncio.run(scenario())
