"""An in-process router in front of in-process fake workers, for gRPC-level router tests."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from procs import free_port
from radixserve.health import check_health
from radixserve.serving import CHANNEL_OPTIONS, serve_until
from radixserve.v1 import router_pb2, router_pb2_grpc, worker_pb2
from router.fake_worker import FakeWorker, start_fake_worker
from router_service.config import RouterConfig
from router_service.server import Router

HEALTH_TIMEOUT_S = 20.0


@dataclass
class Harness:
    stub: router_pb2_grpc.RouterServiceStub
    address: str
    workers: list[FakeWorker]
    # (server, port) per rank; a test that restarts a worker replaces its entry.
    servers: list[tuple[grpc.aio.Server, int]]


async def wait_serving(address: str, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await check_health(address, timeout_s=1.0):
        if loop.time() > deadline:
            raise TimeoutError(f"{address} not SERVING after {timeout_s}s")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running_router(
    num_pages: list[int], config: RouterConfig | None = None, *, host: str = "127.0.0.1", port: int = 0,
    **fake_kwargs,
) -> AsyncIterator[Harness]:
    """Fake worker ranks (one per entry of `num_pages`) and a router on free loopback ports (the
    router at `host`:`port` when `port` is given)."""
    servers = []
    workers = []
    stop = asyncio.Event()
    engine_task = None
    try:
        for rank, pages in enumerate(num_pages):
            server, worker_port, worker = await start_fake_worker(
                rank=rank, world_size=len(num_pages), num_pages=pages, **fake_kwargs
            )
            servers.append((server, worker_port))
            workers.append(worker)
        base = config or RouterConfig()
        router_port = port or free_port()
        config = dataclasses.replace(
            base,
            host=host,
            port=router_port,
            workers=tuple(f"127.0.0.1:{worker_port}" for _, worker_port in servers),
            reconnect_interval_s=0.2,
            metrics_port=0,
        )
        engine_task = asyncio.create_task(serve_until(Router.start, config, stop))
        address = f"{host}:{router_port}"
        await wait_serving(address)
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            yield Harness(router_pb2_grpc.RouterServiceStub(channel), address, workers, servers)
    finally:
        stop.set()
        if engine_task is not None:
            await asyncio.wait_for(engine_task, timeout=15)
        for server, _ in servers:
            await server.stop(0)


def generate_request(
    prompt: list[int], max_tokens: int, *, stop_token_ids: list[int] | None = None,
    logprobs: bool = False, request_id: str = "",
) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=worker_pb2.ResolvedSamplingParams(top_p=1.0, repetition_penalty=1.0, logprobs=logprobs),
        max_tokens=max_tokens,
        stop_token_ids=stop_token_ids or [],
    )


async def collect(stub: router_pb2_grpc.RouterServiceStub, request, timeout_s: float = 30.0):
    """All token ids, logprobs and the last response of one Generate call."""
    token_ids: list[int] = []
    logprobs: list[float] = []
    last = None
    async for response in stub.Generate(request, timeout=timeout_s):
        token_ids.extend(response.token_ids)
        logprobs.extend(item.logprob for item in response.logprobs)
        last = response
    return token_ids, logprobs, last


async def end_codes(calls) -> list[grpc.StatusCode]:
    """Read each Generate call to its end: OK, or the status it failed with."""
    codes = []
    for call in calls:
        try:
            while await call.read() is not grpc.aio.EOF:
                pass
            codes.append(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as exc:
            codes.append(exc.code())
    return codes


async def settled(h: Harness, timeout_s: float = 5.0) -> router_pb2.GetStatsResponse:
    """The router's stats once nothing runs or waits and every release reached rank 0 (releases
    go with the next, idle, task); AssertionError if that takes longer than `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = await h.stub.GetStats(router_pb2.GetStatsRequest())
        if (stats.num_running, stats.num_waiting) == (0, 0) and not h.workers[0].model.requests:
            return stats
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"still running after {timeout_s}s: {stats}")
        await asyncio.sleep(0.05)

