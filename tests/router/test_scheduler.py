"""Scheduler simulation: many requests, a tiny page pool, the fake model as the workers."""

from __future__ import annotations

import random

from router.fake_model import EOS_TOKEN_ID, FakeEntry, FakeModel, expected_tokens
from router_service.core.request import FinishReason, Request
from router_service.core.scheduler import Policy, Scheduler, StepPlan

PAGE_SIZE = 4
CONTEXT_LEN = 100


def to_fake(plan: StepPlan) -> list[FakeEntry]:
    return [
        FakeEntry(
            request_id=entry.request.request_id,
            token_ids=entry.token_ids,
            start_position=entry.start_position,
            page_ids=entry.new_page_ids,
            sample=entry.sample,
            new_request=entry.new_request,
            cached_token_ids=entry.cached_token_ids,
            num_draft_tokens=entry.num_draft_tokens,
        )
        for entry in plan.entries
    ]


def make_scheduler(num_pages: int, policy: Policy, max_batch_tokens: int = 32) -> Scheduler:
    return Scheduler(
        num_pages=num_pages,
        page_size=PAGE_SIZE,
        max_batch_tokens=max_batch_tokens,
        max_running_requests=8,
        policy=policy,
        context_len=CONTEXT_LEN,
        eos_token_ids=frozenset({EOS_TOKEN_ID}),
    )


def random_requests(rng: random.Random, count: int) -> list[tuple[Request, int]]:
    """Requests over a few shared prefixes; each with the eos rate its expected output uses."""
    prefixes = [[rng.randrange(3, 64) for _ in range(rng.randrange(0, 41))] for _ in range(6)]
    requests: list[tuple[Request, int]] = []
    for index in range(count):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 64) for _ in range(rng.randrange(1, 30))]
        if requests and rng.random() < 0.25:
            # A follow-up turn: an earlier request's prompt and output, then a new message;
            # it hits pages that hold generated tokens, including the last one.
            earlier, _ = rng.choice(requests)
            turn = earlier.prompt_ids + expected_tokens(
                earlier.prompt_ids, earlier.max_tokens, eos_every=0,
                stop_token_ids=earlier.stop_token_ids, context_len=CONTEXT_LEN,
            )
            prompt = turn[:60] + [rng.randrange(3, 64) for _ in range(rng.randrange(1, 10))]
        eos_every = 0  # the fake model's eos rate is global; stop ids vary per request instead
        stop = frozenset(rng.sample(range(3, 64), rng.choice([0, 0, 2])))
        request = Request(
            request_id=f"r{index}",
            prompt_ids=prompt,
            max_tokens=rng.randrange(1, 41),
            stop_token_ids=stop,
        )
        requests.append((request, eos_every))
    return requests


def run_to_end(scheduler: Scheduler, model: FakeModel, pending: list[Request], rng: random.Random) -> int:
    num_steps = 0
    while pending or scheduler.waiting or scheduler.running:
        for _ in range(rng.randrange(0, 4)):
            if pending:
                scheduler.add(pending.pop(0))
        plan = scheduler.schedule()
        tokens = model.execute(False, plan.release_request_ids, to_fake(plan))
        scheduler.complete(plan, tokens)
        num_steps += 1
        assert num_steps < 20_000, "the scheduler stopped making progress"
    return num_steps


def check_no_leak(scheduler: Scheduler, num_pages: int) -> None:
    assert scheduler.cache.protected_size == 0
    cached = scheduler.cache.all_page_ids()
    assert len(cached) == len(set(cached)) == scheduler.cache.evictable_size
    assert not any(scheduler.allocator.is_free(page) for page in cached)
    assert scheduler.allocator.num_free + len(cached) == num_pages


def test_200_requests_with_eviction_and_retraction() -> None:
    rng = random.Random(1234)
    num_pages = 40  # 160 token slots for up to 8 running requests of up to 110 tokens
    for policy in (Policy.LPM, Policy.FCFS):
        scheduler = make_scheduler(num_pages, policy)
        model = FakeModel(num_pages, PAGE_SIZE)
        requests = random_requests(rng, 200)
        run_to_end(scheduler, model, [request for request, _ in requests], rng)
        for request, eos_every in requests:
            expected = expected_tokens(
                request.prompt_ids,
                request.max_tokens,
                eos_every=eos_every,
                stop_token_ids=request.stop_token_ids,
                context_len=CONTEXT_LEN,
            )
            assert request.token_ids[request.num_prompt :] == expected, request.request_id
            assert request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        check_no_leak(scheduler, num_pages)
        stats = scheduler.stats
        assert stats.num_retractions > 0, "the pool was meant to force retraction"
        assert stats.cache_hit_tokens > 0
        assert stats.cache_hit_tokens == sum(request.num_cached_tokens for request, _ in requests)
        assert stats.prompt_tokens == sum(request.num_prompt for request, _ in requests)


def test_shared_prefix_is_not_recomputed_and_cancel_frees_pages() -> None:
    num_pages = 32
    scheduler = make_scheduler(num_pages, Policy.LPM, max_batch_tokens=8)
    model = FakeModel(num_pages, PAGE_SIZE)
    prefix = list(range(3, 23))  # 20 tokens = 5 whole pages
    first = Request(request_id="a", prompt_ids=prefix + [40], max_tokens=3)
    scheduler.add(first)
    run_to_end(scheduler, model, [], random.Random(0))
    assert first.num_cached_tokens == 0
    second = Request(request_id="b", prompt_ids=prefix + [41, 42], max_tokens=50)
    scheduler.add(second)
    plan = scheduler.schedule()
    (entry,) = plan.entries
    assert entry.start_position == 20 and entry.new_request and entry.cached_token_ids == prefix
    scheduler.complete(plan, model.execute(False, plan.release_request_ids, to_fake(plan)))
    assert second.num_cached_tokens == 20
    assert scheduler.cancel(second)
    assert second.finish_reason is FinishReason.CANCELLED
    plan = scheduler.schedule()
    assert plan.release_request_ids == ["b"]
    check_no_leak(scheduler, num_pages)


def test_whole_prompt_cached_still_computes_last_token() -> None:
    num_pages = 16
    scheduler = make_scheduler(num_pages, Policy.LPM)
    model = FakeModel(num_pages, PAGE_SIZE)
    prompt = list(range(3, 11))  # exactly two pages
    for name in ("a", "b"):
        request = Request(request_id=name, prompt_ids=prompt, max_tokens=2)
        scheduler.add(request)
        run_to_end(scheduler, model, [], random.Random(0))
        assert request.token_ids[8:] == expected_tokens(prompt, 2, eos_every=0)
    assert request.num_cached_tokens == 4  # capped below the full prompt
    check_no_leak(scheduler, num_pages)


def test_budget_smaller_than_the_running_batch_still_finishes_everything() -> None:
    rng = random.Random(99)
    num_pages = 64
    scheduler = make_scheduler(num_pages, Policy.FCFS, max_batch_tokens=3)  # 8 may run at once
    model = FakeModel(num_pages, PAGE_SIZE)
    requests = [request for request, _ in random_requests(rng, 30)]
    run_to_end(scheduler, model, list(requests), rng)
    for request in requests:
        assert request.token_ids[request.num_prompt :] == expected_tokens(
            request.prompt_ids, request.max_tokens, eos_every=0,
            stop_token_ids=request.stop_token_ids, context_len=CONTEXT_LEN,
        )
    check_no_leak(scheduler, num_pages)


def test_lpm_admits_the_longest_cached_prefix_first_and_fcfs_by_arrival() -> None:
    cached_prefix = list(range(3, 19))  # four pages
    for policy, first in ((Policy.LPM, "hit"), (Policy.FCFS, "miss")):
        scheduler = Scheduler(
            num_pages=32, page_size=PAGE_SIZE, max_batch_tokens=64, max_running_requests=1,
            policy=policy, context_len=CONTEXT_LEN, eos_token_ids=frozenset(),
        )
        model = FakeModel(32, PAGE_SIZE)
        warmup = Request(request_id="warm", prompt_ids=cached_prefix + [30], max_tokens=1)
        scheduler.add(warmup)
        run_to_end(scheduler, model, [], random.Random(0))
        scheduler.add(Request(request_id="miss", prompt_ids=[40, 41, 42, 43, 44], max_tokens=1))
        scheduler.add(Request(request_id="hit", prompt_ids=cached_prefix + [50], max_tokens=1))
        plan = scheduler.schedule()
        assert [entry.request.request_id for entry in plan.entries] == [first]
