"""The livelock of issue 9 against real processes: a router process over a fake worker process
with a pool of 12 pages. Requests that fit always end; one that cannot is refused at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from procs import PYTHON, ServiceProcesses, free_port
from radixserve.serving import CHANNEL_OPTIONS
from radixserve.v1 import router_pb2, router_pb2_grpc
from router.fake_model import expected_tokens
from router.harness import collect, generate_request

FAKE_WORKER = Path(__file__).resolve().parent / "fake_worker.py"
NUM_PAGES, PAGE_SIZE = 12, 4
REQUEST_TIMEOUT_S = 10.0  # a stalled queue shows up as DEADLINE_EXCEEDED


@pytest.mark.timeout(120)
def test_partly_matched_prefix_then_others_all_finish_over_grpc() -> None:
    worker_port, router_port = free_port(), free_port()
    worker_address, router_address = f"127.0.0.1:{worker_port}", f"127.0.0.1:{router_port}"
    with ServiceProcesses() as procs:
        procs.start("worker", [PYTHON, str(FAKE_WORKER), "--port", str(worker_port),
                               "--num-pages", str(NUM_PAGES), "--page-size", str(PAGE_SIZE)])
        procs.wait_healthy(worker_address, timeout_s=60)
        procs.start("router", [PYTHON, "-m", "router_service", "--port", str(router_port),
                               "--workers", worker_address, "--log-level", "WARNING"])
        procs.wait_healthy(router_address, timeout_s=60)

        async def scenario() -> None:
            async with grpc.aio.insecure_channel(router_address, options=CHANNEL_OPTIONS) as channel:
                stub = router_pb2_grpc.RouterServiceStub(channel)
                prompt = [3 + index % 60 for index in range(42)]
                # One 11-page cache node, then a request matching 10 of its pages that needs
                # the whole pool: the shape that stalled the queue.
                for tokens, max_tokens in ((prompt, 6), (prompt[:40] + [60] * 6, 2), ([5, 6, 7], 3)):
                    output, _, last = await collect(
                        stub, generate_request(tokens, max_tokens), timeout_s=REQUEST_TIMEOUT_S
                    )
                    assert output == expected_tokens(tokens, max_tokens, eos_every=0)
                # Prompt + max_tokens beyond the pool: refused up front, naming the sizes.
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await collect(stub, generate_request(prompt, 16), timeout_s=REQUEST_TIMEOUT_S)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "42 tokens plus max_tokens 16" in caught.value.details()
                assert f"holds {NUM_PAGES} pages" in caught.value.details()
                stats = await stub.GetStats(router_pb2.GetStatsRequest(), timeout=5)
                assert stats.num_waiting == stats.num_running == 0
                assert stats.num_pages_free + stats.num_pages_evictable == NUM_PAGES

        asyncio.run(scenario())
