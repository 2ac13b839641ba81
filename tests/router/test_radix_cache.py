"""Radix cache + page allocator against a naive reference, over random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router_service.core.page_allocator import PageAllocator
from router_service.core.radix_cache import RadixCache, RadixNode

PAGE_SIZE = 2
NUM_PAGES = 24

# A tiny alphabet makes sequences share prefixes (and diverge mid-node) all the time.
sequences = st.lists(st.integers(0, 2), min_size=0, max_size=14)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), sequences),
        st.tuples(st.just("insert_unlocked"), sequences),
        st.tuples(st.just("match"), sequences),
        st.tuples(st.just("lock"), sequences),
        st.tuples(st.just("unlock"), st.integers(0, 100)),
        st.tuples(st.just("evict"), st.integers(1, 8)),
    ),
    max_size=60,
)


class Reference:
    """Every cached whole-page prefix, mapped to the page that holds its last page."""

    def __init__(self) -> None:
        self.pages: dict[tuple[int, ...], int] = {}

    def match_len(self, tokens: list[int]) -> int:
        num = 0
        while (num + 1) * PAGE_SIZE <= len(tokens) and tuple(tokens[: (num + 1) * PAGE_SIZE]) in self.pages:
            num += 1
        return num * PAGE_SIZE

    def page_ids(self, tokens: list[int], length: int) -> list[int]:
        return [self.pages[tuple(tokens[: (k + 1) * PAGE_SIZE])] for k in range(length // PAGE_SIZE)]

    def forget(self, page_ids: list[int]) -> None:
        gone = set(page_ids)
        self.pages = {key: page for key, page in self.pages.items() if page not in gone}


def whole_pages(tokens: list[int]) -> list[int]:
    return tokens[: len(tokens) // PAGE_SIZE * PAGE_SIZE]


def scan_evictable_leaves(cache: RadixCache) -> list[RadixNode]:
    """Brute force: every node with no lock and no children (what eviction may take from)."""
    leaves = []
    stack = list(cache.root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.lock_ref == 0 and not node.children:
            leaves.append(node)
    return leaves


def check_leaf_queue(cache: RadixCache) -> None:
    """The cache's ordered leaf queue holds exactly the evictable leaves, each once."""
    queued = cache.evictable_leaves()
    assert len(queued) == len(set(queued))
    assert set(queued) == set(scan_evictable_leaves(cache))


def check_invariants(cache: RadixCache, allocator: PageAllocator, ref: Reference) -> None:
    tree_pages = cache.all_page_ids()
    free = [page for page in range(NUM_PAGES) if allocator.is_free(page)]
    assert len(tree_pages) == len(set(tree_pages)), "a page is in the tree twice"
    assert not set(tree_pages) & set(free), "a page is both free and cached"
    assert len(free) == allocator.num_free
    assert allocator.num_free + allocator.num_used == NUM_PAGES
    # Every page is either free or held by the tree (no request holds pages here).
    assert allocator.num_used == len(tree_pages)
    assert cache.evictable_size + cache.protected_size == len(tree_pages)
    assert set(tree_pages) == set(ref.pages.values())
    for prefix in ref.pages:  # the cache is closed under taking whole-page prefixes
        assert len(prefix) == PAGE_SIZE or prefix[:-PAGE_SIZE] in ref.pages
    check_leaf_queue(cache)


@settings(max_examples=300, deadline=None)
@given(operations)
def test_radix_cache_matches_reference(ops: list[tuple]) -> None:
    cache = RadixCache(PAGE_SIZE)
    allocator = PageAllocator(NUM_PAGES)
    ref = Reference()
    held: list[tuple[object, set[int]]] = []
    for op, arg in ops:
        if op in ("match", "lock"):
            match = cache.match_prefix(arg)
            assert match.matched_len == ref.match_len(arg)
            assert match.page_ids == ref.page_ids(arg, match.matched_len)
            if op == "lock":
                cache.inc_lock_ref(match.last_node)
                held.append((match.last_node, set(match.page_ids)))
        elif op == "unlock" and held:
            node, _ = held.pop(arg % len(held))
            cache.dec_lock_ref(node)
        elif op == "insert":
            tokens = whole_pages(arg)
            match = cache.match_prefix(tokens)
            cache.inc_lock_ref(match.last_node)
            need = len(tokens) // PAGE_SIZE - len(match.page_ids)
            if allocator.num_free < need:
                freed = cache.evict(need - allocator.num_free)
                allocator.free(freed)
                ref.forget(freed)
            if allocator.num_free >= need:
                table = match.page_ids + allocator.alloc(need)
                expected_cached = ref.match_len(tokens)
                num_cached = cache.insert(tokens, table)
                assert num_cached == expected_cached
                allocator.free(table[len(match.page_ids) : num_cached // PAGE_SIZE])
                for k in range(num_cached // PAGE_SIZE, len(table)):
                    ref.pages[tuple(tokens[: (k + 1) * PAGE_SIZE])] = table[k]
            cache.dec_lock_ref(match.last_node)
        elif op == "insert_unlocked":
            # No lock held: the insert may hang a child below an evictable leaf.
            tokens = whole_pages(arg)
            need = len(tokens) // PAGE_SIZE - len(cache.match_prefix(tokens).page_ids)
            if allocator.num_free >= need:
                table = cache.match_prefix(tokens).page_ids + allocator.alloc(need)
                num_cached = cache.insert(tokens, table)
                for k in range(num_cached // PAGE_SIZE, len(table)):
                    ref.pages[tuple(tokens[: (k + 1) * PAGE_SIZE])] = table[k]
        elif op == "evict":
            evictable_before = cache.evictable_size
            # LRU: the first pages taken are from a least recently used leaf.
            leaves = scan_evictable_leaves(cache)
            oldest = min((leaf.last_access for leaf in leaves), default=0)
            lru_pages = {page for leaf in leaves if leaf.last_access == oldest for page in leaf.page_ids}
            freed = cache.evict(arg)
            assert len(freed) == min(arg, evictable_before)
            assert not freed or freed[0] in lru_pages
            locked = set().union(*(pages for _, pages in held))
            assert not set(freed) & locked, "evicted a locked page"
            allocator.free(freed)
            ref.forget(freed)
        check_invariants(cache, allocator, ref)
    for node, _ in held:
        cache.dec_lock_ref(node)
    assert cache.protected_size == 0
    allocator.free(cache.evict(NUM_PAGES))
    assert allocator.num_free == NUM_PAGES


def test_allocator_rejects_double_and_foreign_free() -> None:
    allocator = PageAllocator(4)
    pages = allocator.alloc(2)
    allocator.free(pages[:1])
    with pytest.raises(ValueError, match="twice"):
        allocator.free(pages[:1])
    with pytest.raises(ValueError, match="twice"):
        allocator.free([pages[1], pages[1]])
    with pytest.raises(ValueError, match="not in"):
        allocator.free([4])
    assert allocator.num_free == 3  # failed calls freed nothing


def test_split_keeps_locks_and_lru_evicts_oldest() -> None:
    cache = RadixCache(2)
    assert cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == 0
    locked = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.inc_lock_ref(locked.last_node)
    # Diverging after one page splits the locked node; the lock must still cover all 3 pages.
    assert cache.insert([1, 2, 9, 9], [10, 20]) == 2
    assert cache.protected_size == 3 and cache.evictable_size == 1
    assert cache.evict(5) == [20]
    cache.dec_lock_ref(locked.last_node)
    assert cache.insert([7, 7], [30]) == 0
    cache.match_prefix([7, 7])  # refresh: [7, 7] is now the most recently used
    assert cache.evict(1) == [12]  # the tail page of the least recently used leaf


def test_eviction_order_follows_every_access() -> None:
    cache = RadixCache(2)
    cache.insert([1, 1], [10])
    cache.insert([2, 2, 2, 2], [20, 21])
    cache.insert([3, 3], [30])
    cache.match_prefix([1, 1])  # [1, 1] is now the most recently used, [2, 2, 2, 2] the least
    assert cache.evict(1) == [21]  # a leaf loses its tail first and keeps its place
    assert cache.evict(1) == [20]
    cache.insert([3, 3, 4, 4], [30, 40])  # [3, 3] gains a child: only [3, 3, 4, 4] is a leaf
    assert set(cache.evictable_leaves()) == set(scan_evictable_leaves(cache))
    locked = cache.match_prefix([1, 1]).last_node
    cache.inc_lock_ref(locked)
    assert cache.evict(1) == [40]  # the locked [1, 1] is skipped, not lost
    cache.dec_lock_ref(locked)
    assert cache.evict(2) == [30, 10]  # [3, 3] became a leaf when its child went
