"""Overlap scheduling over real gRPC with fake worker ranks: the same outputs with overlap on and
off, pages all accounted for, worker idle time reported, and a rank killed during an
overlapped step fails the requests in flight within the step deadline; the router recovers."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest

from procs import PYTHON, ServiceProcesses, free_port, is_serving
from radixserve.serving import CHANNEL_OPTIONS
from radixserve.v1 import generation_pb2, router_pb2, router_pb2_grpc
from router.fake_model import expected_tokens
from router.fake_worker import fake_logprob
from router.harness import collect, end_codes, generate_request, running_router
from router_service.config import RouterConfig
from router_service.core.speculation import SpeculationConfig
from router_service.engine import Engine

FAKE_WORKER = Path(__file__).resolve().parent / "fake_worker.py"
PAGE_SIZE = 4
EOS_EVERY = 11
# Long enough that the router plans the next step while a fake rank still runs this one.
STEP_DELAY_S = 0.004
# The idle test's steps: long enough that a router process the machine schedules a few
# milliseconds late still has the next task waiting (4 ms steps failed that under load).
IDLE_STEP_DELAY_S = 0.02
# A pool of 14 pages for 6 requests of up to ~40 tokens: some are retracted.
TINY_POOL = 14
STEP_TIMEOUT_S = 3.0
RETRACTION_ATTEMPTS = 3
NO_SPECULATION = SpeculationConfig(speculative=False)


def workload() -> list[router_pb2.RouterGenerateRequest]:
    requests = []
    for index in range(6):
        prompt = [3 + (index * 7 + k) % 60 for k in range(5 + 3 * index)]
        request = generate_request(prompt, 10 + 4 * index, logprobs=index % 2 == 0,
                                   stop_token_ids=[40, 41] if index % 3 == 0 else None)
        requests.append(request)
    return requests


def expected(request: router_pb2.RouterGenerateRequest, eos_every: int) -> list[int]:
    return expected_tokens(list(request.prompt_token_ids), request.max_tokens, eos_every=eos_every,
                           stop_token_ids=frozenset(request.stop_token_ids))


async def cancelled_after(stub, request, num_tokens: int) -> list[int]:
    """Read `num_tokens` tokens, then go away."""
    call = stub.Generate(request, timeout=30)
    tokens: list[int] = []
    while len(tokens) < num_tokens:
        response = await call.read()
        tokens.extend(response.token_ids)
    call.cancel()
    return tokens


async def run_workload(overlap: bool, num_ranks: int, num_pages: int, eos_every: int) -> dict:
    # Speculation off: a request that may draft makes its steps wait (speculation goes before
    # overlap), and this test counts steps run ahead (test_speculative has both on).
    config = RouterConfig(overlap=overlap, max_batch_tokens=16, max_running_requests=6, speculation=NO_SPECULATION)
    async with running_router([num_pages] * num_ranks, config, page_size=PAGE_SIZE,
                              eos_every=eos_every, step_delay_s=STEP_DELAY_S) as h:
        requests = workload()
        long_one = generate_request(list(range(5, 13)), 30)
        results = await asyncio.gather(
            *(collect(h.stub, request) for request in requests),
            cancelled_after(h.stub, long_one, 5),
        )
        outputs = [(tokens, logprobs, last.finish_reason) for tokens, logprobs, last in results[:-1]]
        for _ in range(100):  # the cancelled request's pages come back within a step
            stats = await h.stub.GetStats(router_pb2.GetStatsRequest(), timeout=5)
            if stats.num_running == 0:
                break
            await asyncio.sleep(0.02)
        return dict(
            requests=requests, outputs=outputs, cancelled=results[-1], long_one=long_one,
            stats=stats, errors=[w.errors for w in h.workers],
            resolved=[w.num_resolved for w in h.workers],
        )


def check_run(run: dict, eos_every: int, num_ranks: int) -> None:
    """What every run must show, overlap on or off."""
    for request, (tokens, logprobs, _) in zip(run["requests"], run["outputs"]):
        assert tokens == expected(request, eos_every)
        if request.sampling.logprobs:
            assert logprobs == pytest.approx([fake_logprob(t) for t in tokens])
    assert run["cancelled"] == expected(run["long_one"], eos_every)[:len(run["cancelled"])]
    assert run["errors"] == [[]] * num_ranks
    stats = run["stats"]
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_pages_free + stats.num_pages_evictable == stats.num_pages_total
    assert stats.num_idle_measured_steps > 0


def run_checked(overlap: bool, num_ranks: int, num_pages: int, eos_every: int) -> dict:
    """A checked run; in the tiny pool, run again (RETRACTION_ATTEMPTS in all at most) until one
    retracts: whether the pool runs out depends on how the requests' arrivals interleave with the
    steps, which a loaded machine moves (a clean-clone run once saw none)."""
    for _ in range(RETRACTION_ATTEMPTS):
        run = asyncio.run(run_workload(overlap, num_ranks, num_pages, eos_every))
        check_run(run, eos_every, num_ranks)
        if num_pages != TINY_POOL or run["stats"].num_retractions > 0:
            break
    return run


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_ranks, num_pages, eos_every", [(1, TINY_POOL, 0), (2, 64, EOS_EVERY)])
def test_outputs_equal_with_overlap_on_and_off(num_ranks: int, num_pages: int, eos_every: int) -> None:
    """EOS and stop ids (ending requests one step late), max_tokens, logprobs, a cancellation;
    in a tiny pool (retractions) on one rank, and on two ranks."""
    on = run_checked(True, num_ranks, num_pages, eos_every)
    off = run_checked(False, num_ranks, num_pages, eos_every)
    assert on["outputs"] == off["outputs"]
    # Every rank resolved decode tokens it was not sent, only with overlap on.
    assert all(count > 20 for count in on["resolved"]) and off["resolved"] == [0] * num_ranks
    if eos_every:
        assert any(finish == generation_pb2.FINISH_REASON_STOP for _, _, finish in on["outputs"])
    if num_pages == TINY_POOL:
        assert on["stats"].num_retractions > 0 and off["stats"].num_retractions > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("device", "setting", "expected"), [
    ("cuda:0", None, True), ("fake", None, True), ("cpu", None, False), ("", None, False),
    ("cuda:0", False, False), ("cpu", True, True)])
def test_overlap_defaults_to_off_on_cpu_workers_and_on_otherwise(device, setting, expected) -> None:
    """Unset, --overlap follows the workers' device: on the CPU (or unnamed) the router's work
    would compete with the forward pass; a CUDA forward pass, or the stack bench's fake, leaves
    the CPU to the router. Set, it is what it says; the ranks resolve tokens they were not sent
    only when steps ran ahead."""
    async def scenario() -> int:
        config = RouterConfig(overlap=setting, speculation=NO_SPECULATION)
        async with running_router([64, 64], config, device=device, step_delay_s=STEP_DELAY_S) as h:
            await asyncio.gather(*(collect(h.stub, generate_request([3, 4, 5 + i], 12)) for i in range(3)))
            return sum(w.num_resolved for w in h.workers)

    assert (asyncio.run(scenario()) > 0) is expected


@pytest.mark.timeout(120)
def test_worker_idle_between_steps_is_in_stats_and_metrics() -> None:
    async def scenario() -> router_pb2.GetStatsResponse:
        async with running_router([64], RouterConfig(overlap=True), step_delay_s=IDLE_STEP_DELAY_S) as h:
            await asyncio.gather(*(collect(h.stub, generate_request([3, 4, 5 + i], 20)) for i in range(4)))
            return await h.stub.GetStats(router_pb2.GetStatsRequest(), timeout=5)

    stats = asyncio.run(scenario())
    assert stats.num_idle_measured_steps >= 19
    # The next task was always waiting when the fake finished one: far below a step's time.
    assert 0 <= stats.worker_idle_p50_s < IDLE_STEP_DELAY_S / 2
    assert stats.worker_idle_s_total >= stats.worker_idle_p50_s
    assert 0 < stats.router_step_cpu_p50_s < 1.0
    engine = Engine(RouterConfig())
    engine.metrics.step_costs(0.0004, 0.00015)
    exposed = generate_latest(engine.metrics.registry).decode()
    assert 'radixserve:worker_idle_between_steps_seconds_bucket{le="0.0002",model_name=""} 1.0' in exposed
    assert 'radixserve:router_step_cpu_seconds_bucket{le="0.0005",model_name=""} 1.0' in exposed


@pytest.mark.timeout(180)
def test_rank_killed_during_an_overlapped_step_fails_in_flight_within_the_deadline() -> None:
    ports = [free_port(), free_port()]
    router_port = free_port()
    addresses = [f"127.0.0.1:{port}" for port in ports]
    router_address = f"127.0.0.1:{router_port}"

    def worker_cmd(rank: int) -> list[str]:
        return [PYTHON, str(FAKE_WORKER), "--port", str(ports[rank]), "--rank", str(rank),
                "--world-size", "2", "--step-delay-s", "0.01", "--num-pages", "512"]

    with ServiceProcesses() as procs, ServiceProcesses() as doomed:
        procs.start("worker0", worker_cmd(0))
        doomed.start("worker1", worker_cmd(1))
        for address in addresses:
            procs.wait_healthy(address, timeout_s=60)
        procs.start("router", [
            PYTHON, "-m", "router_service", "--port", str(router_port), "--workers", ",".join(addresses),
            "--reconnect-interval-s", "0.2", "--step-timeout-s", str(STEP_TIMEOUT_S),
            "--metrics-port", "0", "--log-level", "WARNING", "--overlap",
        ])
        procs.wait_healthy(router_address, timeout_s=60)

        async def streams_after(fault) -> tuple[list[grpc.StatusCode], float]:
            async with grpc.aio.insecure_channel(router_address, options=CHANNEL_OPTIONS) as channel:
                stub = router_pb2_grpc.RouterServiceStub(channel)
                calls = [stub.Generate(generate_request([3, 4, 5 + i], 400), timeout=30) for i in range(4)]
                for call in calls:  # every stream is running, steps overlapped
                    await call.read()
                fault()
                faulted_at = time.monotonic()
                codes = await end_codes(calls)
                return codes, time.monotonic() - faulted_at

        # Frozen: nothing breaks, only the step deadline can tell.
        frozen = doomed.procs["worker1"].pid
        try:
            codes, took = asyncio.run(streams_after(lambda: os.killpg(frozen, signal.SIGSTOP)))
        finally:
            os.killpg(frozen, signal.SIGCONT)
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 4
        assert took < STEP_TIMEOUT_S + 2, took
        procs.wait_healthy(router_address, timeout_s=60)
        # Killed: the stream breaks at once.
        codes, took = asyncio.run(streams_after(lambda: doomed.kill("worker1")))
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 4
        assert took < STEP_TIMEOUT_S, took
        assert not is_serving(router_address)
        procs.start("worker1-restarted", worker_cmd(1))
        procs.wait_healthy(router_address, timeout_s=60)

        async def generate_again() -> list[int]:
            async with grpc.aio.insecure_channel(router_address, options=CHANNEL_OPTIONS) as channel:
                tokens, _, _ = await collect(router_pb2_grpc.RouterServiceStub(channel),
                                             generate_request([3, 4, 5], 8))
                return tokens

        assert asyncio.run(generate_again()) == expected_tokens([3, 4, 5], 8, eos_every=0)
        assert procs.procs["router"].poll() is None
