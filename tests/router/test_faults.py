"""A worker process killed mid-stream: requests fail fast with UNAVAILABLE, the router recovers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from procs import PYTHON, ServiceProcesses, free_port, is_serving
from radixserve.health import check_health
from radixserve.serving import CHANNEL_OPTIONS, serve_until
from radixserve.v1 import router_pb2_grpc
from router.fake_model import expected_tokens
from router.fake_worker import start_fake_worker
from router.harness import collect, end_codes, generate_request, running_router, wait_serving

FAKE_WORKER = Path(__file__).resolve().parent / "fake_worker.py"
# Generous bound for "within seconds": a hang shows up as DEADLINE_EXCEEDED instead.
FAIL_DEADLINE_S = 20.0


@pytest.mark.timeout(120)
def test_worker_killed_mid_stream_then_restarted() -> None:
    worker_port, router_port = free_port(), free_port()
    worker_address, router_address = f"127.0.0.1:{worker_port}", f"127.0.0.1:{router_port}"
    worker_cmd = [PYTHON, str(FAKE_WORKER), "--port", str(worker_port), "--step-delay-s", "0.02"]
    # The first worker lives in its own group: once killed, it must not count as a crash.
    with ServiceProcesses() as procs, ServiceProcesses() as doomed:
        doomed.start("worker", worker_cmd)
        doomed.wait_healthy(worker_address, timeout_s=60)
        procs.start("router", [
            PYTHON, "-m", "router_service", "--port", str(router_port), "--workers", worker_address,
            "--reconnect-interval-s", "0.2", "--log-level", "WARNING",
        ])
        procs.wait_healthy(router_address, timeout_s=60)

        async def fail_in_flight() -> list[grpc.StatusCode]:
            async with grpc.aio.insecure_channel(router_address, options=CHANNEL_OPTIONS) as channel:
                stub = router_pb2_grpc.RouterServiceStub(channel)
                calls = [
                    stub.Generate(generate_request([3, 4, 5 + i], 200), timeout=FAIL_DEADLINE_S)
                    for i in range(4)
                ]
                for call in calls:  # every stream is running
                    await call.read()
                doomed.kill("worker")
                return await end_codes(calls)

        assert asyncio.run(fail_in_flight()) == [grpc.StatusCode.UNAVAILABLE] * 4
        assert not is_serving(router_address)

        procs.start("worker-restarted", worker_cmd)
        procs.wait_healthy(worker_address, timeout_s=60)
        procs.wait_healthy(router_address, timeout_s=60)

        async def generate_again() -> list[int]:
            async with grpc.aio.insecure_channel(router_address, options=CHANNEL_OPTIONS) as channel:
                stub = router_pb2_grpc.RouterServiceStub(channel)
                tokens, _, _ = await collect(stub, generate_request([3, 4, 5], 8))
                return tokens

        assert asyncio.run(generate_again()) == expected_tokens([3, 4, 5], 8, eos_every=0)
        assert procs.procs["router"].poll() is None


@pytest.mark.timeout(60)
def test_worker_gone_while_idle_turns_health_off_until_it_is_back() -> None:
    async def scenario() -> None:
        async with running_router([32]) as h:
            server, port = h.servers[0]
            await server.stop(0)
            for _ in range(200):  # no request in flight: the broken stream alone must be noticed
                if not await check_health(h.address, timeout_s=1.0):
                    break
                await asyncio.sleep(0.05)
            assert not await check_health(h.address, timeout_s=1.0)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(h.stub, generate_request([3, 4, 5], 3))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            restarted, _, _ = await start_fake_worker(port=port, num_pages=32)
            h.servers[0] = (restarted, port)
            await wait_serving(h.address)
            tokens, _, _ = await collect(h.stub, generate_request([3, 4, 5], 3))
            assert tokens == expected_tokens([3, 4, 5], 3, eos_every=0)

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_dead_engine_loop_turns_health_off_and_ends_serve(monkeypatch) -> None:
    from router_service import server as router_server
    from router_service.config import RouterConfig
    from router_service.engine import Engine

    async def crash(self, stop) -> None:
        raise RuntimeError("bug in the engine loop")

    async def scenario() -> None:
        server, port, _ = await start_fake_worker(num_pages=8)
        health_states: list[bool] = []
        original_set = router_server.start_server

        async def recording_start_server(*args, **kwargs):
            server_, health_, bound = await original_set(*args, **kwargs)
            original = health_.set

            async def set_and_record(serving: bool) -> None:
                health_states.append(serving)
                await original(serving)

            health_.set = set_and_record
            return server_, health_, bound

        monkeypatch.setattr(router_server, "start_server", recording_start_server)
        monkeypatch.setattr(Engine, "run", crash)
        config = RouterConfig(port=free_port(), workers=(f"127.0.0.1:{port}",), metrics_port=0)
        try:
            # The engine crash ends serving with a failure status.
            status = await asyncio.wait_for(
                serve_until(router_server.Router.start, config, asyncio.Event()), timeout=20)
            assert status == 1
        finally:
            await server.stop(0)
        assert health_states and health_states[-1] is False

    asyncio.run(scenario())
