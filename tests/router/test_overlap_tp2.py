"""Overlap scheduling against two real worker ranks (a tiny random Llama, TP=2 over gloo): greedy
and seeded outputs are the same with overlap on and off, across stop ids, `max_tokens`, a
cancellation and retraction in a tiny pool, and the pages all come back.

One worker group serves both runs: the router connects, resets the ranks, runs the workload
with overlap on, stops; a second router does the same with overlap off.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from procs import ServiceProcesses, free_port, start_worker_ranks
from radixserve.serving import CHANNEL_OPTIONS, serve_until
from radixserve.v1 import generation_pb2, router_pb2, router_pb2_grpc, worker_pb2
from router.harness import wait_serving
from router_service.config import RouterConfig
from router_service.core.speculation import SpeculationConfig
from router_service.server import Router
from worker.tiny_models import VOCAB_SIZE, make_tiny_llama

READY_TIMEOUT_S = 120.0
PAGE_SIZE = 4
# 14 pages of 4 tokens for 8 requests of up to ~45 tokens each: the pool runs out, so some
# requests are retracted and resumed.
NUM_PAGES = 14
CANCEL_AFTER = 4
LOGPROB_TOLERANCE = 1e-4


def workload() -> list[router_pb2.RouterGenerateRequest]:
    rng = random.Random(3)
    requests = []
    for index in range(8):
        sampling = worker_pb2.ResolvedSamplingParams(top_p=1.0, repetition_penalty=1.0)
        if index % 2:  # seeded sampling
            sampling.temperature = 0.9
            sampling.has_seed = True
            sampling.seed = 100 + index
            sampling.logprobs = True
        requests.append(router_pb2.RouterGenerateRequest(
            request_id=f"r{index}",
            prompt_token_ids=[rng.randrange(3, VOCAB_SIZE) for _ in range(6 + 2 * index)],
            sampling=sampling,
            max_tokens=12 + 3 * index,
            # A few ids each: some requests stop on one, one step before overlap knows it.
            stop_token_ids=rng.sample(range(3, VOCAB_SIZE), 6) if index % 3 == 0 else [],
        ))
    return requests


async def run(workers: tuple[str, ...], overlap: bool) -> dict:
    port = free_port()
    config = RouterConfig(
        port=port, workers=workers, overlap=overlap, max_pages=NUM_PAGES, max_batch_tokens=24,
        max_running_requests=8, reconnect_interval_s=0.2, metrics_port=0,
        speculation=SpeculationConfig(speculative=False),  # it counts steps run ahead
    )
    stop = asyncio.Event()
    router = asyncio.create_task(serve_until(Router.start, config, stop))
    try:
        address = f"127.0.0.1:{port}"
        await wait_serving(address, timeout_s=60)
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)

            async def collect(request) -> tuple[list[int], list[float], int]:
                tokens, logprobs, finish = [], [], 0
                async for response in stub.Generate(request, timeout=120):
                    tokens.extend(response.token_ids)
                    logprobs.extend(item.logprob for item in response.logprobs)
                    finish = response.finish_reason
                return tokens, logprobs, finish

            async def cancelled(request) -> list[int]:
                call = stub.Generate(request, timeout=120)
                tokens: list[int] = []
                while len(tokens) < CANCEL_AFTER:
                    tokens.extend((await call.read()).token_ids)
                call.cancel()
                return tokens

            requests = workload()
            long_one = router_pb2.RouterGenerateRequest()
            long_one.CopyFrom(requests[0])
            long_one.request_id, long_one.max_tokens = "cancelled", 40
            del long_one.stop_token_ids[:]
            results = await asyncio.gather(*(collect(r) for r in requests), cancelled(long_one))
            for _ in range(200):
                stats = await stub.GetStats(router_pb2.GetStatsRequest(), timeout=5)
                if stats.num_running == 0:
                    break
                await asyncio.sleep(0.05)
            return dict(outputs=results[:-1], cancelled=results[-1], stats=stats)
    finally:
        stop.set()
        await asyncio.wait_for(router, timeout=30)


@pytest.mark.timeout(300)
def test_tp2_outputs_equal_with_overlap_on_and_off(tmp_path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    with ServiceProcesses() as procs:
        addresses = start_worker_ranks(procs, model, 2, [
            "--kv-cache-mb", "4", "--page-size", str(PAGE_SIZE), "--metrics-port", "0",
            "--dtype", "float32",
        ])
        for address in addresses:
            procs.wait_healthy(address, timeout_s=READY_TIMEOUT_S)
        on = asyncio.run(run(tuple(addresses), overlap=True))
        off = asyncio.run(run(tuple(addresses), overlap=False))
        for name in ("worker0", "worker1"):
            assert "rejected" not in procs.tail(name, 200_000)

    # Same tokens and endings; logprobs to float tolerance (the batches differ, so the sums do).
    assert [(t, f) for t, _, f in on["outputs"]] == [(t, f) for t, _, f in off["outputs"]]
    for (_, on_logprobs, _), (_, off_logprobs, _) in zip(on["outputs"], off["outputs"]):
        assert on_logprobs == pytest.approx(off_logprobs, abs=LOGPROB_TOLERANCE)
    finishes = [finish for _, _, finish in on["outputs"]]
    assert generation_pb2.FINISH_REASON_STOP in finishes
    assert generation_pb2.FINISH_REASON_LENGTH in finishes
    greedy_first = on["outputs"][0][0]
    for run_ in (on, off):
        # The cancelled request shares request 0's prompt and greedy settings.
        num_common = min(len(run_["cancelled"]), len(greedy_first))
        assert run_["cancelled"][:num_common] == greedy_first[:num_common]
        stats = run_["stats"]
        assert stats.num_running == stats.num_waiting == 0
        assert stats.num_pages_free + stats.num_pages_evictable == stats.num_pages_total == NUM_PAGES
        assert stats.num_retractions > 0
