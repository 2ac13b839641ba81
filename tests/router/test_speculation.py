"""Speculative decoding in the scheduler, against the fake model that verifies drafts like rank 0.

The fake model (`cyclic_next_token`) repeats itself with occasional jumps, so n-gram drafts are
often accepted and sometimes rejected; every output must still be exactly what one token per
step gives, pages must all come back, and nothing past a stop may enter the cache.
"""

from __future__ import annotations

import random

from router.fake_model import EOS_TOKEN_ID, FakeModel, cyclic_next_token, expected_tokens
from router.test_scheduler import CONTEXT_LEN, PAGE_SIZE, to_fake
from router_service.core.request import FinishReason, Request
from router_service.core.scheduler import Policy, Scheduler
from router_service.core.speculation import SpeculationConfig

SPECULATION = SpeculationConfig(speculative_k=5, speculative_min_ngram=1, speculative_max_ngram=3,
                                speculative_max_running=3)


def make_scheduler(num_pages: int, max_batch_tokens: int = 48,
                   speculation: SpeculationConfig | None = SPECULATION) -> Scheduler:
    return Scheduler(
        num_pages=num_pages, page_size=PAGE_SIZE, max_batch_tokens=max_batch_tokens,
        max_running_requests=6, policy=Policy.LPM, context_len=CONTEXT_LEN,
        eos_token_ids=frozenset({EOS_TOKEN_ID}), speculation=speculation,
    )


def expected(request: Request) -> list[int]:
    return expected_tokens(request.prompt_ids, request.max_tokens, eos_every=0,
                           stop_token_ids=request.stop_token_ids, context_len=CONTEXT_LEN,
                           rule=cyclic_next_token)


def step(scheduler: Scheduler, model: FakeModel) -> None:
    plan = scheduler.schedule()
    assert sum(len(entry.token_ids) for entry in plan.entries) <= scheduler.max_batch_tokens
    decoding = [entry for entry in plan.entries if not entry.new_request and entry.num_draft_tokens >= 0
                and len(entry.token_ids) - entry.num_draft_tokens == 1 and entry.sample]
    if len(decoding) > SPECULATION.speculative_max_running:
        assert not any(entry.num_draft_tokens for entry in decoding), "drafts in a compute-bound step"
    tokens = model.execute(False, plan.release_request_ids, to_fake(plan))
    scheduler.complete(plan, tokens, model.last_accepted)


def run_all(scheduler: Scheduler, model: FakeModel, requests: list[Request], rng: random.Random) -> None:
    pending = list(requests)
    for _ in range(20_000):
        if not (pending or scheduler.waiting or scheduler.running):
            return
        for _ in range(rng.randrange(0, 3)):
            if pending:
                scheduler.add(pending.pop(0))
        step(scheduler, model)
    raise AssertionError("the scheduler stopped making progress")


def assert_pages_all_back(scheduler: Scheduler) -> None:
    assert scheduler.pages.audit(scheduler.running) == []
    assert scheduler.allocator.num_free + scheduler.cache.evictable_size == scheduler.allocator.num_pages


def random_requests(rng: random.Random, count: int) -> list[Request]:
    requests = []
    for index in range(count):
        passage = [rng.randrange(3, 64) for _ in range(rng.randrange(2, 12))]
        prompt = passage * rng.randrange(1, 4) + [rng.randrange(3, 64) for _ in range(rng.randrange(1, 8))]
        stop = frozenset(rng.sample(range(3, 9), rng.choice([0, 0, 1])))
        requests.append(Request(request_id=f"r{index}", prompt_ids=prompt,
                                max_tokens=rng.randrange(1, 50), stop_token_ids=stop))
    return requests


def test_outputs_are_exact_and_pages_come_back_under_a_pool_that_forces_retraction() -> None:
    rng = random.Random(12)
    for num_pages in (200, 24):
        scheduler = make_scheduler(num_pages)
        model = FakeModel(num_pages, PAGE_SIZE, rule=cyclic_next_token)
        requests = random_requests(rng, 40)
        run_all(scheduler, model, requests, rng)
        for request in requests:
            assert request.token_ids[request.num_prompt:] == expected(request), request.request_id
            assert 0 <= request.draft.num_accepted <= request.draft.num_drafted
            assert request.draft.num_accepted <= request.num_output - 1
        stats = scheduler.stats
        assert stats.num_accepted_draft_tokens == sum(r.draft.num_accepted for r in requests)
        assert stats.num_draft_tokens == sum(r.draft.num_drafted for r in requests)
        # Both outcomes happen, so both paths were exercised.
        assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
        assert_pages_all_back(scheduler)
    assert stats.num_retractions > 0  # the small pool


def single(prompt: list[int], max_tokens: int, stop: frozenset[int] = frozenset()) -> tuple[Request, Scheduler]:
    scheduler = make_scheduler(64)
    model = FakeModel(64, PAGE_SIZE, rule=cyclic_next_token)
    request = Request(request_id="one", prompt_ids=prompt, max_tokens=max_tokens, stop_token_ids=stop)
    scheduler.add(request)
    while scheduler.running or scheduler.waiting:
        step(scheduler, model)
    return request, scheduler


def test_a_stop_token_inside_an_accepted_run_ends_the_output_there_and_is_not_cached() -> None:
    prompt = [3, 4, 5, 6, 7, 8] * 3  # the cycle itself: drafts from the prompt are accepted
    free_run, _ = single(prompt, 40)
    output = free_run.token_ids[len(prompt):]
    stop_token = 7
    request, scheduler = single(prompt, 40, frozenset({stop_token}))
    got = request.token_ids[len(prompt):]
    assert got == output[: output.index(stop_token) + 1]
    assert request.finish_reason is FinishReason.STOP
    assert request.draft.num_accepted > 0
    # The cache holds whole pages of the sequence before the stop token, never past it.
    match = scheduler.cache.match_prefix(request.token_ids + [3] * PAGE_SIZE)
    assert match.matched_len <= len(request.token_ids) - 1
    assert_pages_all_back(scheduler)


def test_max_tokens_and_the_context_cut_accepted_runs_exactly() -> None:
    prompt = [3, 4, 5, 6, 7, 8] * 3
    for max_tokens in (2, 5, 11):
        request, scheduler = single(prompt, max_tokens)
        assert request.num_output == max_tokens
        assert request.token_ids[len(prompt):] == expected(request)
        assert_pages_all_back(scheduler)
    request, scheduler = single([3, 4, 5, 6, 7, 8] * 15, 1000)  # 90 of the 100 positions
    assert request.finish_reason is FinishReason.LENGTH
    assert len(request.token_ids) == CONTEXT_LEN
    assert request.token_ids[90:] == expected(request)


def test_cancelling_in_the_middle_of_speculation_frees_every_page() -> None:
    scheduler = make_scheduler(64)
    model = FakeModel(64, PAGE_SIZE, rule=cyclic_next_token)
    request = Request(request_id="c", prompt_ids=[3, 4, 5, 6, 7, 8] * 3, max_tokens=60)
    scheduler.add(request)
    while request.draft.num_accepted == 0:
        step(scheduler, model)
    assert scheduler.cancel(request)
    plan = scheduler.schedule()
    assert plan.release_request_ids == ["c"]
    assert_pages_all_back(scheduler)


def test_a_request_whose_drafts_fail_backs_off() -> None:
    """The hashing fake model never repeats its context, so drafts are rejected: the request
    must soon stop drafting at most steps, and its output is still exact."""
    scheduler = make_scheduler(64)
    model = FakeModel(64, PAGE_SIZE)  # the hash model
    prompt = [5, 6] * 20
    request = Request(request_id="b", prompt_ids=prompt, max_tokens=60)
    scheduler.add(request)
    num_steps = 0
    while scheduler.running or scheduler.waiting:
        step(scheduler, model)
        num_steps += 1
    assert request.token_ids[len(prompt):] == expected_tokens(prompt, 60, eos_every=0)
    stats = scheduler.stats
    assert stats.num_draft_entries < num_steps / 3


def run_timed(per_draft_s: float, decode_s: float = 0.010) -> tuple[Request, Scheduler]:
    """One request through the cyclic model (most drafts accepted, every ninth position not),
    each step reported to the speculator as lasting `decode_s` plus `per_draft_s` a draft."""
    scheduler = make_scheduler(64)
    model = FakeModel(64, PAGE_SIZE, rule=cyclic_next_token)
    request = Request(request_id="timed", prompt_ids=[5, 6, 7, 8, 9, 10] * 4, max_tokens=300)
    scheduler.add(request)
    for _ in range(1000):
        if not (scheduler.running or scheduler.waiting):
            break
        plan = scheduler.schedule()
        tokens = model.execute(False, plan.release_request_ids, to_fake(plan))
        drafts = sum(entry.num_draft_tokens for entry in plan.entries)
        scheduler.observe_step(plan, decode_s + per_draft_s * drafts)
        scheduler.complete(plan, tokens, model.last_accepted)
    assert request.token_ids[request.num_prompt:] == expected(request)
    return request, scheduler


def test_the_measured_cost_of_a_draft_sets_the_acceptance_drafting_must_keep() -> None:
    """Steps of one request: a plain step's time and each verified draft's share of a longer one,
    measured, give the acceptance under which drafting loses time; prefills and steps of two
    entries teach nothing; the configured floor holds where drafts are cheap."""
    cheap, scheduler = run_timed(per_draft_s=0.0005)
    cost = scheduler.speculator.cost
    assert abs(cost.decode_s - 0.010) < 1e-9 and abs(cost.per_draft_s - 0.0005) < 1e-9
    assert abs(cost.break_even() - 0.05) < 1e-6
    assert scheduler.speculator.min_acceptance() == SPECULATION.speculative_min_acceptance
    # The cyclic model's drafts are mostly right: cheap drafts are verified most steps.
    assert cheap.draft.num_drafted > 50, cheap.draft.num_drafted
    # A draft costing more than a step never pays: only the probes after ever longer pauses.
    dear, scheduler = run_timed(per_draft_s=0.012)
    assert abs(scheduler.speculator.min_acceptance() - 1.2) < 1e-6
    assert dear.draft.num_drafted < cheap.draft.num_drafted / 2, (dear.draft.num_drafted, cheap.draft.num_drafted)
    # A prefill, and a step of two requests, are no plain decode step.
    fresh = make_scheduler(64)
    for index in range(2):
        fresh.add(Request(request_id=f"p{index}", prompt_ids=[5, 6, 7], max_tokens=4))
    plan = fresh.schedule()
    fresh.observe_step(plan, 1.0)
    assert fresh.speculator.cost.decode_s == 0.0 and fresh.speculator.cost.break_even() == 0.0
