"""Prefix sharing while requests run: pages are cached as soon as they are written, and a burst
sharing an uncached prefix waits for one prefill instead of computing the prefix many times."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.fake_model import EOS_TOKEN_ID, FakeModel, expected_tokens
from router.harness import collect, generate_request, running_router
from router.test_radix_cache import check_leaf_queue
from router.test_scheduler import check_no_leak, to_fake
from router_service.config import RouterConfig
from router_service.core.page_allocator import PageAllocator
from router_service.core.radix_cache import RadixCache
from router_service.core.request import Request
from router_service.core.scheduler import Policy, Scheduler

PAGE_SIZE = 4
PREFIX_LEN = 600  # 150 whole pages
NUM_BURST = 16


def make_scheduler(num_pages: int, max_batch_tokens: int, policy: Policy) -> Scheduler:
    return Scheduler(
        num_pages=num_pages,
        page_size=PAGE_SIZE,
        max_batch_tokens=max_batch_tokens,
        max_running_requests=NUM_BURST,
        policy=policy,
        context_len=4096,
        eos_token_ids=frozenset({EOS_TOKEN_ID}),
    )


def run_burst(max_batch_tokens: int, policy: Policy) -> tuple[list[Request], int, Scheduler]:
    """16 requests sharing an uncached prefix, all queued before the first step.

    Returns the requests, how many prefix positions the workers computed in total, and the
    scheduler (run to the end).
    """
    rng = random.Random(5)
    prefix = [rng.randrange(3, 64) for _ in range(PREFIX_LEN)]
    # Room for every request's own copy of the prefix: the pool does not hold any of them back.
    num_pages = 4096
    scheduler = make_scheduler(num_pages, max_batch_tokens, policy)
    model = FakeModel(num_pages, PAGE_SIZE)
    requests = []
    for index in range(NUM_BURST):
        # A distinct first suffix token: the requests share exactly the prefix's pages.
        suffix = [3 + index] + [rng.randrange(3, 64) for _ in range(rng.randrange(12))]
        requests.append(Request(request_id=f"r{index}", prompt_ids=prefix + suffix, max_tokens=8))
    for request in requests:
        scheduler.add(request)
    num_prefix_computed = 0
    num_steps = 0
    while scheduler.waiting or scheduler.running:
        plan = scheduler.schedule()
        for entry in plan.entries:
            end = min(PREFIX_LEN, entry.start_position + len(entry.token_ids))
            num_prefix_computed += max(0, end - entry.start_position)
        scheduler.complete(plan, model.execute(False, plan.release_request_ids, to_fake(plan)))
        num_steps += 1
        assert num_steps < 1000, "the burst stopped making progress"
    check_no_leak(scheduler, num_pages)
    return requests, num_prefix_computed, scheduler


@pytest.mark.parametrize("policy", [Policy.LPM, Policy.FCFS])
# Chunked prefill, and the whole burst fitting in one step's budget.
@pytest.mark.parametrize("max_batch_tokens", [256, NUM_BURST * (PREFIX_LEN + 16)])
def test_burst_sharing_an_uncached_prefix_computes_it_about_once(
    max_batch_tokens: int, policy: Policy
) -> None:
    requests, num_prefix_computed, scheduler = run_burst(max_batch_tokens, policy)
    # Before: every request of the burst was admitted at once and computed the whole prefix.
    assert num_prefix_computed <= 2 * PREFIX_LEN
    for request in requests:
        assert request.token_ids[request.num_prompt :] == expected_tokens(
            request.prompt_ids, request.max_tokens, eos_every=0
        ), request.request_id
    # One request computed the prefix; every deferred one hit all of its pages.
    hits = sorted(request.num_cached_tokens for request in requests)
    assert hits[0] == 0 and hits[1:] == [PREFIX_LEN] * (NUM_BURST - 1)
    assert scheduler.stats.cache_hit_tokens == (NUM_BURST - 1) * PREFIX_LEN


def test_pages_written_by_a_decoding_request_are_matchable_while_it_runs() -> None:
    num_pages = 64
    scheduler = make_scheduler(num_pages, max_batch_tokens=64, policy=Policy.LPM)
    model = FakeModel(num_pages, PAGE_SIZE)
    first = Request(request_id="first", prompt_ids=list(range(3, 13)), max_tokens=30)
    scheduler.add(first)

    def step() -> None:
        plan = scheduler.schedule()
        scheduler.complete(plan, model.execute(False, plan.release_request_ids, to_fake(plan)))

    while first.num_computed < 22:  # 5 whole pages written: 10 prompt + 12 decoded tokens
        step()
    assert first.finish_reason is None
    assert first.num_tree_pages == 5 and scheduler.cache.protected_size == 5
    # Written pages that hold decoded tokens, not only the prompt, are in the tree.
    shared = first.token_ids[:20]
    second = Request(request_id="second", prompt_ids=shared + [60, 61], max_tokens=5)
    scheduler.add(second)
    plan = scheduler.schedule()
    (entry,) = [entry for entry in plan.entries if entry.request is second]
    assert entry.new_request and entry.start_position == 20 and entry.cached_token_ids == shared
    scheduler.complete(plan, model.execute(False, plan.release_request_ids, to_fake(plan)))
    assert second.num_cached_tokens == 20
    while scheduler.running or scheduler.waiting:
        step()
    for request in (first, second):
        assert request.token_ids[request.num_prompt :] == expected_tokens(
            request.prompt_ids, request.max_tokens, eos_every=0
        )
    check_no_leak(scheduler, num_pages)


def test_cancelling_a_request_whose_pages_are_shared_keeps_them_for_the_other() -> None:
    num_pages = 64
    scheduler = make_scheduler(num_pages, max_batch_tokens=64, policy=Policy.LPM)
    model = FakeModel(num_pages, PAGE_SIZE)
    prefix = list(range(3, 27))  # 6 pages
    first = Request(request_id="first", prompt_ids=prefix + [40], max_tokens=20)
    second = Request(request_id="second", prompt_ids=prefix + [41], max_tokens=20)
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.schedule()
    # The second waits for the first's prefill rather than computing the same 6 pages.
    assert [entry.request for entry in plan.entries] == [first]
    scheduler.complete(plan, model.execute(False, plan.release_request_ids, to_fake(plan)))
    plan = scheduler.schedule()
    scheduler.complete(plan, model.execute(False, plan.release_request_ids, to_fake(plan)))
    assert second.num_cached_tokens == len(prefix)
    assert scheduler.cancel(first)
    assert scheduler.cache.protected_size == 6  # still locked by the second
    while scheduler.running or scheduler.waiting:
        plan = scheduler.schedule()
        scheduler.complete(plan, model.execute(False, plan.release_request_ids, to_fake(plan)))
    assert second.token_ids[second.num_prompt :] == expected_tokens(
        second.prompt_ids, second.max_tokens, eos_every=0
    )
    check_no_leak(scheduler, num_pages)


def test_extend_grows_the_own_leaf_splits_where_needed_and_refuses_duplicates() -> None:
    cache = RadixCache(2)
    root = cache.root
    # A running sequence caches its first two pages: a new leaf it locks instead of the root.
    leaf = cache.extend([1, 2, 3, 4], [10, 11], 0, root)
    assert leaf is not None and leaf.page_ids == [10, 11]
    cache.inc_lock_ref(leaf)
    # Two more: its own leaf grows in place (the same node, still locked by it).
    assert cache.extend([1, 2, 3, 4, 5, 6, 7, 8], [10, 11, 12, 13], 2, leaf) is leaf
    assert leaf.page_ids == [10, 11, 12, 13]
    assert cache.protected_size == 4 and cache.evictable_size == 0
    # Another sequence holding only page 10 of the tree computed [3, 4] and [5, 6] itself:
    # its pages 21, 22 duplicate 11, 12, so nothing of it is inserted.
    assert cache.extend([1, 2, 3, 4, 5, 6], [10, 21, 22], 1, leaf) is None
    # Nor the pages it has past the duplicates: they would hang below pages that are not in
    # its page table, and be both its own and the tree's.
    assert cache.extend([1, 2, 3, 4, 5, 6, 9, 9], [10, 21, 22, 23], 1, leaf) is None
    assert sorted(cache.all_page_ids()) == [10, 11, 12, 13]
    # One that matched the leaf's first two pages (and so locked the leaf) diverges after them:
    # the leaf is split (it keeps its lower half, so the first sequence's lock stays right) and
    # the new pages hang below the upper half.
    match = cache.match_prefix([1, 2, 3, 4, 9])
    assert match.last_node is leaf and match.page_ids == [10, 11]
    cache.inc_lock_ref(leaf)
    fork = cache.extend([1, 2, 3, 4, 9, 9], [10, 11, 30], 2, leaf)
    assert fork is not None and fork.page_ids == [30] and fork.parent is leaf.parent
    cache.inc_lock_ref(fork)
    cache.dec_lock_ref(leaf)
    assert leaf.page_ids == [12, 13] and leaf.lock_ref == 1 and leaf.parent.lock_ref == 2
    assert cache.match_prefix([1, 2, 3, 4, 9, 9]).page_ids == [10, 11, 30]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).page_ids == [10, 11, 12, 13]
    # The fork's own leaf ends where its pages do, so it grows in place too.
    assert cache.extend([1, 2, 3, 4, 9, 9, 8, 8], [10, 11, 30, 31], 3, fork) is fork
    assert cache.protected_size == 6 and cache.evictable_size == 0
    cache.dec_lock_ref(leaf)
    assert cache.protected_size == 4 and cache.evict(9) == [12, 13]
    cache.dec_lock_ref(fork)
    assert cache.protected_size == 0 and cache.evictable_size == 4


# ---- extend under random interleavings, against the allocator ---------------------------------

PROP_PAGE_SIZE = 2
PROP_NUM_PAGES = 40


class Holder:
    """A running sequence as the scheduler keeps it: tree pages first, then its own pages."""

    def __init__(self, tokens: list[int], match) -> None:
        self.tokens = tokens
        self.page_table = list(match.page_ids)
        self.num_tree_pages = len(match.page_ids)
        self.last_node = match.last_node


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("start"), st.lists(st.integers(0, 1), min_size=2, max_size=12)),
            st.tuples(st.just("write"), st.integers(0, 100)),
            st.tuples(st.just("end"), st.integers(0, 100)),
            st.tuples(st.just("evict"), st.integers(1, 6)),
        ),
        max_size=50,
    )
)
def test_extend_keeps_tree_locks_and_pages_consistent(ops: list[tuple]) -> None:
    size = PROP_PAGE_SIZE
    cache = RadixCache(size)
    allocator = PageAllocator(PROP_NUM_PAGES)
    holders: list[Holder] = []

    def give_back(holder: Holder) -> None:
        # What `PageManager.give_back` does with every written page.
        num_full = len(holder.page_table)
        tokens = holder.tokens[: num_full * size]
        num_cached = cache.insert(tokens, holder.page_table) // size
        allocator.free(holder.page_table[holder.num_tree_pages : num_cached])
        cache.dec_lock_ref(holder.last_node)

    for op, arg in ops:
        if op == "start":
            match = cache.match_prefix(arg)
            cache.inc_lock_ref(match.last_node)
            holders.append(Holder(arg, match))
        elif op == "write" and holders:
            holder = holders[arg % len(holders)]
            if len(holder.page_table) * size + size > len(holder.tokens):
                continue
            if allocator.num_free == 0:
                allocator.free(cache.evict(1))
            if allocator.num_free == 0:
                continue
            holder.page_table += allocator.alloc(1)  # one more page written
            num_full = len(holder.page_table)
            node = cache.extend(
                holder.tokens[: num_full * size],
                holder.page_table,
                holder.num_tree_pages,
                holder.last_node,
            )
            if node is not None:
                cache.inc_lock_ref(node)
                cache.dec_lock_ref(holder.last_node)
                holder.last_node, holder.num_tree_pages = node, num_full
        elif op == "end" and holders:
            give_back(holders.pop(arg % len(holders)))
        elif op == "evict":
            allocator.free(cache.evict(arg))
        tree_pages = cache.all_page_ids()
        own_pages = [
            page for holder in holders for page in holder.page_table[holder.num_tree_pages :]
        ]
        assert len(set(tree_pages)) == len(tree_pages)
        assert not set(tree_pages) & set(own_pages)
        assert allocator.num_used == len(tree_pages) + len(own_pages)
        assert cache.total_size == len(tree_pages)
        check_leaf_queue(cache)
        for holder in holders:  # a holder's tree pages are still cached, and still its own
            match = cache.match_prefix(holder.tokens[: holder.num_tree_pages * size])
            assert match.page_ids == holder.page_table[: holder.num_tree_pages]
    for holder in holders:
        give_back(holder)
    assert cache.protected_size == 0
    allocator.free(cache.evict(PROP_NUM_PAGES))
    assert allocator.num_free == PROP_NUM_PAGES


@pytest.mark.timeout(60)
def test_burst_over_grpc_reports_the_hits_in_usage() -> None:
    async def scenario() -> None:
        config = RouterConfig(max_batch_tokens=256, max_running_requests=NUM_BURST)
        async with running_router([2048], config, page_size=PAGE_SIZE) as harness:
            rng = random.Random(11)
            prefix = [rng.randrange(3, 64) for _ in range(PREFIX_LEN)]
            prompts = [prefix + [3 + index, rng.randrange(3, 64)] for index in range(NUM_BURST)]
            results = await asyncio.gather(
                *(collect(harness.stub, generate_request(prompt, 6)) for prompt in prompts)
            )
            for prompt, (token_ids, _, last) in zip(prompts, results):
                assert token_ids == expected_tokens(prompt, 6, eos_every=0)
            hits = sorted(last.usage.cached_tokens for _, _, last in results)
            assert hits == [0] + [PREFIX_LEN] * (NUM_BURST - 1)
            assert not harness.workers[0].errors

    asyncio.run(scenario())
