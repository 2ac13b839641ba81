"""Progress: every request ends, nothing leaks, a request that fits is never cut short.

Regression for the livelock of issue 9 (a prompt one token short of the pool, run twice): the
second run matched a partly used cache node; its lock protected the node's unmatched tail too,
so admission could neither use nor evict those pages and the queue stalled forever.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.fake_model import EOS_TOKEN_ID, FakeModel, expected_tokens
from router.test_scheduler import PAGE_SIZE, check_no_leak, to_fake
from router_service.core.request import FinishReason, Request
from router_service.core.scheduler import Policy, Scheduler
from router_service.errors import InvalidRequest

MAX_STEPS = 5_000


def scheduler_for(num_pages: int, context_len: int = 1 << 20, **kwargs) -> Scheduler:
    options = dict(max_batch_tokens=32, max_running_requests=8, policy=Policy.LPM)
    options.update(kwargs)
    return Scheduler(
        num_pages=num_pages, page_size=PAGE_SIZE, context_len=context_len,
        eos_token_ids=frozenset({EOS_TOKEN_ID}), **options,
    )


def drive(scheduler: Scheduler, model: FakeModel, arrivals: list[list[Request]]) -> set[str]:
    """Run steps until every request ended (one batch of `arrivals` joins per step); returns
    the ids of the requests `add` rejected. Fails if a step is idle while requests wait."""
    arrivals = list(arrivals)
    rejected: set[str] = set()
    for _ in range(MAX_STEPS):
        if arrivals:
            for request in arrivals.pop(0):
                try:
                    scheduler.add(request)
                except InvalidRequest:
                    rejected.add(request.request_id)
        plan = scheduler.schedule()
        assert not plan.is_empty or not (scheduler.waiting or scheduler.running), (
            "the scheduler went idle with requests queued"
        )
        assert all(request.finish_reason is not FinishReason.FAILED for request in plan.ended)
        scheduler.complete(plan, model.execute(False, plan.release_request_ids, to_fake(plan)))
        assert scheduler.audit_when_idle() == [] if plan.is_empty else True
        if not arrivals and not scheduler.waiting and not scheduler.running:
            return rejected
    raise AssertionError("the scheduler stopped making progress")


def test_a_partly_matched_cache_node_does_not_stall_the_queue() -> None:
    """The mechanism of the issue's livelock, with requests that fit the pool.

    `first` leaves one 11-page node in the cache (its leaf grows in place while it decodes).
    `second` shares its first 10 pages and needs the whole pool of 12. Locking the matched node
    used to protect all 11 of its pages, so only 1 page was free or evictable where 2 were
    needed: `second` never ran and everything queued behind it waited forever.
    """
    num_pages = 12
    scheduler = scheduler_for(num_pages, max_batch_tokens=64)  # whole prompts in one chunk
    model = FakeModel(num_pages, PAGE_SIZE)
    prompt = [3 + index % 60 for index in range(42)]
    first = Request(request_id="first", prompt_ids=prompt, max_tokens=6)
    drive(scheduler, model, [[first]])
    (node,) = scheduler.cache.root.children.values()
    assert len(node.page_ids) == 11 and not node.children
    second = Request(request_id="second", prompt_ids=prompt[:40] + [60] * 6, max_tokens=2)
    hello = Request(request_id="hello", prompt_ids=[5, 6, 7, 8], max_tokens=3)
    drive(scheduler, model, [[second], [hello]])
    for request in (first, second, hello):
        assert request.finish_reason is FinishReason.LENGTH
        assert request.token_ids[request.num_prompt :] == expected_tokens(
            request.prompt_ids, request.max_tokens, eos_every=0
        )
    assert second.num_cached_tokens == 40
    assert scheduler.audit_when_idle() == []
    check_no_leak(scheduler, num_pages)


def test_a_leaf_another_request_grows_does_not_pin_pages_for_one_that_runs_alone() -> None:
    """Found by the property test below (PAGE_SIZE 4, 14 pages): `twin` and `alone` have the
    same one-token prompt, so they compute the same tokens; `twin` cached its pages first and
    `alone` keeps its own copies, locking the leaf of the first page both hold. `twin` used to
    grow that leaf in place, so `alone`'s lock protected `twin`'s pages too: once `long` and
    `twin` ended, `alone` (11 pages at its end) ran alone with no page for position 40 and was
    failed. A leaf locked by others too now gets a child instead."""
    num_pages = 14
    scheduler = scheduler_for(num_pages, context_len=64, max_batch_tokens=3, max_running_requests=4,
                              policy=Policy.FCFS)
    model = FakeModel(num_pages, PAGE_SIZE)
    requests = [Request(request_id="long", prompt_ids=[3] * 38, max_tokens=6),
                Request(request_id="twin", prompt_ids=[3], max_tokens=21),
                Request(request_id="alone", prompt_ids=[3], max_tokens=41)]
    drive(scheduler, model, [requests])
    for request in requests:
        assert request.finish_reason is FinishReason.LENGTH
        assert request.token_ids[request.num_prompt :] == expected_tokens(
            request.prompt_ids, request.max_tokens, eos_every=0, context_len=64)
    check_no_leak(scheduler, num_pages)


def test_request_beyond_the_pool_is_rejected_naming_the_sizes() -> None:
    scheduler = scheduler_for(11)
    prompt = list(range(3, 3 + 11 * PAGE_SIZE - 1))
    with pytest.raises(InvalidRequest, match=r"43 .*16 .*11 pages"):
        scheduler.add(Request(request_id="big", prompt_ids=prompt, max_tokens=16))
    # The context caps what max_tokens can reach: then the same request fits.
    capped = scheduler_for(11, context_len=len(prompt) + 1)
    capped.add(Request(request_id="capped", prompt_ids=prompt, max_tokens=16))


@st.composite
def workloads(draw: st.DrawFn) -> tuple[int, int, list[list[Request]]]:
    num_pages = draw(st.integers(1, 24))
    slots = num_pages * PAGE_SIZE
    context_len = draw(st.sampled_from([slots + 8, 1 << 20]))
    prefix = draw(st.lists(st.integers(3, 63), max_size=slots))
    batches: list[list[Request]] = []
    for batch_index in range(draw(st.integers(1, 6))):
        batch = []
        for index in range(draw(st.integers(0, 4))):
            prompt_len = draw(st.integers(1, slots))
            shared = draw(st.integers(0, min(prompt_len, len(prefix))))
            tail = draw(st.lists(st.integers(3, 63), min_size=prompt_len - shared,
                                 max_size=prompt_len - shared))
            batch.append(Request(
                request_id=f"r{batch_index}.{index}", prompt_ids=prefix[:shared] + tail,
                max_tokens=draw(st.integers(1, slots)),
            ))
        batches.append(batch)
    return num_pages, context_len, batches


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 40), st.sampled_from(list(Policy)))
def test_every_request_ends_as_defined_and_nothing_leaks(
    workload: tuple[int, int, list[list[Request]]], max_batch_tokens: int, policy: Policy
) -> None:
    num_pages, context_len, batches = workload
    scheduler = scheduler_for(num_pages, context_len, max_batch_tokens=max_batch_tokens,
                              max_running_requests=4, policy=policy)
    model = FakeModel(num_pages, PAGE_SIZE)
    rejected = drive(scheduler, model, batches)
    slots = num_pages * PAGE_SIZE
    for request in (request for batch in batches for request in batch):
        final_len = min(request.num_prompt + request.max_tokens, context_len)
        too_big = final_len - 1 > slots or request.num_prompt >= context_len
        assert too_big == (request.request_id in rejected), request
        if too_big:
            continue
        expected = expected_tokens(request.prompt_ids, request.max_tokens, eos_every=0,
                                   context_len=context_len)
        assert request.token_ids[request.num_prompt:] == expected, request.request_id
        assert request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    check_no_leak(scheduler, num_pages)
