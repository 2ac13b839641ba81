"""One bad request fails one request: the router refuses what a worker would reject, and a task
the workers reject anyway (a router bug) fails only the requests in it; the cache survives."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from radixserve.health import check_health
from radixserve.v1 import router_pb2
from router.fake_model import expected_tokens
from router.fake_worker import FakeWorker
from router.harness import collect, generate_request, running_router


async def status_of(stub, request) -> grpc.StatusCode:
    try:
        await collect(stub, request, timeout_s=10)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.timeout(60)
def test_router_refuses_what_a_worker_would_reject_and_keeps_serving_others() -> None:
    async def scenario() -> None:
        async with running_router([32]) as h:
            long_run = asyncio.ensure_future(collect(h.stub, generate_request([3, 4, 5], 60)))
            bad = [
                generate_request([3, 4], 2, request_id="x" * 100_000),
                generate_request([3, 4], 2, logprobs=True),
                generate_request([3, 99], 2),  # beyond the fake vocabulary of 64
                generate_request([3, 4], 0),
            ]
            bad[1].sampling.top_logprobs = 21
            bad.append(generate_request([3, 4], 2))
            bad[-1].sampling.top_p = 0.0
            bad.append(generate_request([3, 4], 2))
            bad[-1].sampling.temperature = float("nan")
            codes = await asyncio.gather(*(status_of(h.stub, request) for request in bad))
            assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * len(bad)
            tokens, _, _ = await long_run
            assert tokens == expected_tokens([3, 4, 5], 60, eos_every=0)
            assert h.workers[0].errors == []  # nothing bad ever reached the worker

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_rejected_task_fails_its_requests_only_and_the_cache_survives(monkeypatch) -> None:
    run_task = FakeWorker.run_task

    def reject_poison(self: FakeWorker, task):  # a router bug the router cannot see
        if any(entry.request_id.startswith("poison") for entry in task.entries):
            self.errors.append("poison")
            reply = run_task(self, type(task)(task_id=task.task_id))
            reply.error.code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
            reply.error.message = "rejected for the test"
            return reply
        return run_task(self, task)

    monkeypatch.setattr(FakeWorker, "run_task", reject_poison)
    prompt = list(range(3, 3 + 4 * 6))  # six whole pages

    async def scenario() -> None:
        async with running_router([64]) as h:
            first, _, _ = await collect(h.stub, generate_request(prompt, 8))
            poisoned = generate_request(prompt + [40, 41], 4, request_id="poison")
            assert await status_of(h.stub, poisoned) == grpc.StatusCode.INTERNAL
            # With overlap, the step planned on top of the rejected one names it too.
            assert h.workers[0].errors in (["poison"], ["poison", "poison"])
            assert await check_health(h.address, timeout_s=2)
            again, _, last = await collect(h.stub, generate_request(prompt, 8))
            assert again == first == expected_tokens(prompt, 8, eos_every=0)
            assert last.usage.cached_tokens == len(prompt) - 4  # all but the last page
            stats = await h.stub.GetStats(router_pb2.GetStatsRequest(), timeout=5)
            assert stats.num_running == stats.num_waiting == 0
            assert stats.num_pages_free + stats.num_pages_evictable == stats.num_pages_total

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_constraint_that_fails_on_rank_0_ends_its_request_with_an_error(monkeypatch) -> None:
    """Rank 0 reports a request whose constraint its matcher could no longer follow: the router
    ends that request with INVALID_ARGUMENT naming the failure (never as a finished output), frees
    its pages, and the others in the step go on."""
    run_task = FakeWorker.run_task
    failed_steps = []

    def fail_the_constrained(self: FakeWorker, task):
        reply = run_task(self, task)
        broken = [token.request_id for token in reply.tokens if token.request_id.startswith("broken")]
        if broken and self.rank == 0:  # the id the workers know it by
            failed_steps.append(task.task_id)
            reply.constraint_failures.add(request_id=broken[0], message="a token the grammar could not take")
        return reply

    monkeypatch.setattr(FakeWorker, "run_task", fail_the_constrained)

    async def scenario() -> None:
        async with running_router([64]) as h:
            neighbour = asyncio.ensure_future(collect(h.stub, generate_request([3, 4, 5], 30)))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(h.stub, generate_request([6, 7, 8], 30, request_id="broken"), timeout_s=10)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "could not follow it" in caught.value.details()
            assert "a token the grammar could not take" in caught.value.details()
            tokens, _, _ = await neighbour
            assert tokens == expected_tokens([3, 4, 5], 30, eos_every=0)
            assert failed_steps
            stats = await h.stub.GetStats(router_pb2.GetStatsRequest(), timeout=5)
            assert stats.num_running == stats.num_waiting == 0
            assert stats.num_pages_free + stats.num_pages_evictable == stats.num_pages_total

    asyncio.run(scenario())
