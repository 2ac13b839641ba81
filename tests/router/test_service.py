"""The router over gRPC against fake workers: exact tokens, usage, errors, cancellation."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from radixserve.v1 import generation_pb2, router_pb2
from router.fake_model import EOS_TOKEN_ID, expected_tokens
from router.fake_worker import fake_logprob
from router.harness import collect, generate_request, running_router, settled
from router_service.config import RouterConfig

EOS_EVERY = 40
PAGE_SIZE = 4


def expected(prompt: list[int], max_tokens: int, stop: list[int] | None = None) -> list[int]:
    return expected_tokens(
        prompt, max_tokens, eos_every=EOS_EVERY, stop_token_ids=frozenset(stop or [])
    )


@pytest.mark.timeout(60)
def test_mixed_load_gives_exact_tokens_over_two_ranks() -> None:
    async def scenario() -> None:
        config = RouterConfig(max_batch_tokens=16, max_running_requests=6)
        async with running_router([210, 200], config, eos_every=EOS_EVERY, page_size=PAGE_SIZE) as h:
            info = await h.stub.GetServerInfo(router_pb2.GetServerInfoRequest())
            assert (info.model.num_pages, info.model.tp_size, info.model.page_size) == (200, 2, PAGE_SIZE)
            assert list(info.eos_token_ids) == [EOS_TOKEN_ID]
            rng = random.Random(7)
            shared = [rng.randrange(3, 64) for _ in range(23)]
            cases = []
            for index in range(12):
                prompt = shared[: rng.randrange(0, 24)] + [rng.randrange(3, 64) for _ in range(rng.randrange(1, 40))]
                stop = rng.sample(range(3, 64), 3) if index % 3 == 0 else []
                cases.append((prompt, rng.randrange(1, 30), stop))
            results = await asyncio.gather(*(
                collect(h.stub, generate_request(p, m, stop_token_ids=s, logprobs=i % 2 == 0))
                for i, (p, m, s) in enumerate(cases)
            ))
            for index, ((prompt, max_tokens, stop), (tokens, logprobs, last)) in enumerate(zip(cases, results)):
                want = expected(prompt, max_tokens, stop)
                assert tokens == want
                ended_by_stop = want[-1] == EOS_TOKEN_ID or want[-1] in stop
                reason = generation_pb2.FINISH_REASON_STOP if ended_by_stop else generation_pb2.FINISH_REASON_LENGTH
                assert last.finish_reason == reason
                assert last.usage.prompt_tokens == len(prompt)
                assert last.usage.completion_tokens == len(want)
                assert logprobs == ([pytest.approx(fake_logprob(t)) for t in want] if index % 2 == 0 else [])
            # A follow-up that shares the first request's whole prompt hits the cache.
            prompt = cases[0][0] + [5, 6, 7]
            tokens, _, last = await collect(h.stub, generate_request(prompt, 5))
            assert tokens == expected(prompt, 5)
            assert last.usage.cached_tokens == (len(cases[0][0]) // PAGE_SIZE) * PAGE_SIZE
            stats = await h.stub.GetStats(router_pb2.GetStatsRequest())
            assert stats.cache_hit_tokens >= last.usage.cached_tokens > 0
            assert stats.prompt_tokens == sum(len(p) for p, _, _ in cases) + len(prompt)
            assert all(not worker.errors for worker in h.workers)

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_bad_input_and_full_queue() -> None:
    async def scenario() -> None:
        config = RouterConfig(max_batch_tokens=8, max_running_requests=1, max_queue=1)
        async with running_router([32], config, context_len=64, step_delay_s=0.02) as h:
            for request in (
                generate_request([], 5),
                generate_request([3, 4], 0),
                generate_request(list(range(3, 60)) + [3] * 7, 5),  # fills the whole context
                generate_request([3, 99999], 5),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await collect(h.stub, request)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # One runs, one waits; the third finds the queue full.
            calls = [h.stub.Generate(generate_request([3, 4, 5 + i], 20)) for i in range(3)]
            codes = []
            for call in calls:
                try:
                    async for _ in call:
                        pass
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
            assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1
            assert codes.count(grpc.StatusCode.OK) >= 1

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_cancelled_streams_leave_and_pages_come_back() -> None:
    async def scenario() -> None:
        config = RouterConfig(max_batch_tokens=64, max_running_requests=20)
        async with running_router([400], config, step_delay_s=0.005) as h:
            before = await h.stub.GetStats(router_pb2.GetStatsRequest())
            assert before.num_pages_free == before.num_pages_total == 400
            rng = random.Random(3)
            prompts = [[rng.randrange(3, 64) for _ in range(rng.randrange(5, 30))] for _ in range(20)]
            max_tokens = 200  # long enough that a loaded machine still cancels midway
            calls = [h.stub.Generate(generate_request(p, max_tokens)) for p in prompts]

            async def read(index: int):
                tokens: list[int] = []
                async for response in calls[index]:
                    tokens.extend(response.token_ids)
                    if index % 2 and len(tokens) >= 5:
                        calls[index].cancel()
                        return tokens, None
                    if response.finish_reason:
                        return tokens, response
                return tokens, None

            results = await asyncio.gather(*(read(i) for i in range(20)), return_exceptions=True)
            for index, result in enumerate(results):
                if index % 2:  # cancelled by its caller midway
                    tokens, last = result
                    assert last is None and 5 <= len(tokens) < max_tokens
                    continue
                tokens, last = result
                assert tokens == expected_tokens(prompts[index], max_tokens, eos_every=0)
                assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
            stats = await settled(h)
            assert stats.num_pages_free + stats.num_pages_evictable == stats.num_pages_total
            assert stats.num_pages_used == stats.num_pages_evictable
            assert h.workers[0].model.requests == {}  # every request was released on the worker
            assert not h.workers[0].errors

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_tiny_pool_retracts_and_still_gives_exact_tokens() -> None:
    async def scenario() -> None:
        config = RouterConfig(max_batch_tokens=12, max_running_requests=6)
        async with running_router([20], config, page_size=PAGE_SIZE) as h:
            rng = random.Random(11)
            prompts = [[rng.randrange(3, 64) for _ in range(rng.randrange(4, 16))] for _ in range(8)]
            results = await asyncio.gather(*(collect(h.stub, generate_request(p, 40)) for p in prompts))
            for prompt, (tokens, _, last) in zip(prompts, results):
                assert tokens == expected_tokens(prompt, 40, eos_every=0)
                assert last.usage.completion_tokens == 40
            stats = await h.stub.GetStats(router_pb2.GetStatsRequest())
            assert stats.num_retractions > 0
            assert stats.num_pages_free + stats.num_pages_evictable == stats.num_pages_total == 20
            assert not h.workers[0].errors

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_served_model_name_replaces_the_workers_name() -> None:
    async def scenario() -> None:
        async with running_router([50], RouterConfig(), page_size=PAGE_SIZE) as h:
            workers_name = (await h.stub.GetServerInfo(router_pb2.GetServerInfoRequest())).model.model_name
        config = RouterConfig(served_model_name="my-model")
        async with running_router([50], config, page_size=PAGE_SIZE) as h:
            info = await h.stub.GetServerInfo(router_pb2.GetServerInfoRequest())
        assert workers_name and workers_name != "my-model"
        assert info.model.model_name == "my-model"

    asyncio.run(scenario())
