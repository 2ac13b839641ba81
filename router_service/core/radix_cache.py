"""The prefix cache: a page-aligned radix tree from token ids to the KV pages that hold them.

Every node's key is a whole number of pages (`len(key) % page_size == 0`), with one page id per
`page_size` tokens, so only whole pages are ever shared. A node's children are keyed by their
first page of tokens; two children never share a first page.

Contract for users:
- `match_prefix` returns pages that are owned by the tree. Call `lock(match)` before using them
  (before anything can evict) and `dec_lock_ref` on the node it returns exactly once when done.
  A lock on a node protects it and all its ancestors from eviction; `lock` first splits a node
  that was matched only partly, so that a holder never protects pages it does not use (those
  would be neither usable by it nor evictable for it: the livelock of issue 9).
- `insert(token_ids, page_ids)` hands the pages after the already-cached prefix to the tree. The
  pages covering that already-cached prefix stay with the caller: the ones that are not the
  tree's own (duplicates computed twice) must be freed by the caller.
- `extend(token_ids, page_ids, num_own_pages, node)` caches a still-running sequence's written
  pages and returns the node to lock instead of the old one; it inserts nothing when the tree
  already holds more of the sequence than the caller's own pages (the caller's pages are
  duplicates).
- `evict(num_pages)` removes least recently used unlocked leaf pages and returns their ids;
  the caller gives them back to the page allocator.
The evictable leaves (no lock, no children) wait in a queue ordered by last access, kept up to
date on every match, lock, unlock, insert, split and eviction, so that one eviction costs
O(log n) in the number of leaves rather than a walk over all of them.
Matching never changes which pages a key maps to (it only refreshes access times); inserting
may split a node in two, and extending may lengthen a leaf in place; both keep every lock valid
(a lock may come to protect more pages than its holder uses, never fewer).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import NamedTuple

# The leaf queue is rebuilt from its live entries when stale ones outnumber them this many times
# over: rebuilding is O(n), paid for by the n stale pushes before it (O(1) amortized each).
STALE_ENTRY_RATIO = 2


class RadixNode:
    """One edge of the tree: `key` tokens held by `page_ids` (one page per `page_size` tokens).

    `lock_ref` counts the holders whose locked node is this node or one of its descendants.
    """

    __slots__ = ("key", "page_ids", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: list[int], page_ids: list[int], parent: RadixNode | None) -> None:
        self.key = key
        self.page_ids = page_ids
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0


class MatchResult(NamedTuple):
    """The cached prefix of a token sequence.

    `page_ids` hold the first `matched_len` tokens (`matched_len == len(page_ids) * page_size`).
    `last_node` is where the match ends (the root when nothing matched); its first
    `num_last_node_pages` pages are matched, perhaps not all of them.
    """

    page_ids: list[int]
    matched_len: int
    last_node: RadixNode
    num_last_node_pages: int = 0


class LeafQueue:
    """The tree's evictable leaves, least recently used first (ties: first queued first).

    A heap with lazy invalidation: a node's one live entry is the one `_live` maps it to, so
    re-queueing a node (its access time changed) or dropping it only changes `_live`; stale
    entries are skipped when they reach the top. Every operation is O(log n) amortized.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._live: dict[RadixNode, tuple[int, int, RadixNode]] = {}
        self._order = itertools.count()

    def __contains__(self, node: RadixNode) -> bool:
        return node in self._live

    def nodes(self) -> list[RadixNode]:
        return list(self._live)

    def push(self, node: RadixNode) -> None:
        """Queue `node` at its `last_access`, replacing its entry if it had one."""
        entry = (node.last_access, next(self._order), node)
        self._live[node] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > STALE_ENTRY_RATIO * len(self._live) + 1:
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def discard(self, node: RadixNode) -> None:
        self._live.pop(node, None)

    def first(self) -> RadixNode | None:
        """The least recently used leaf (it stays queued), or None when there is none."""
        heap = self._heap
        while heap and self._live.get(heap[0][2]) is not heap[0]:
            heapq.heappop(heap)
        return heap[0][2] if heap else None


class RadixCache:
    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.root = RadixNode([], [], None)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = itertools.count(1)
        self._num_evictable = 0
        self._num_protected = 0
        self._leaves = LeafQueue()

    @property
    def evictable_size(self) -> int:
        """Pages held only by the tree (no lock on them): reclaimable by `evict`."""
        return self._num_evictable

    @property
    def protected_size(self) -> int:
        """Pages of the tree that some lock holder is using."""
        return self._num_protected

    @property
    def total_size(self) -> int:
        return self._num_evictable + self._num_protected

    def _page_key(self, token_ids: list[int], start: int) -> tuple[int, ...]:
        return tuple(token_ids[start : start + self.page_size])

    def _common_pages(self, node: RadixNode, token_ids: list[int], start: int) -> int:
        """How many whole pages of `node.key` equal `token_ids[start:]` (the first one does)."""
        size = self.page_size
        num_pages = min(len(node.page_ids), (len(token_ids) - start) // size)
        count = 1
        while count < num_pages:
            offset = count * size
            if node.key[offset : offset + size] != token_ids[start + offset : start + offset + size]:
                break
            count += 1
        return count

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """The longest cached whole-page prefix of `token_ids`.

        The last node may be matched only partly (its first pages): locking it protects more
        pages than were matched, never fewer.
        """
        node = self.root
        page_ids: list[int] = []
        start = 0
        count = 0
        now = next(self._clock)
        size = self.page_size
        while len(token_ids) - start >= size:
            child = node.children.get(self._page_key(token_ids, start))
            if child is None:
                break
            self._touch(child, now)
            count = self._common_pages(child, token_ids, start)
            page_ids.extend(child.page_ids[:count])
            start += count * size
            node = child
            if count < len(child.page_ids):
                break
        return MatchResult(page_ids, start, node, count)

    def lock(self, match: MatchResult) -> RadixNode:
        """Lock exactly the pages of `match` (fresh: nothing changed the tree since it was
        made); returns the node to pass to `dec_lock_ref` when done.

        A partly matched last node is split first, so that its unmatched tail stays evictable.
        """
        node = match.last_node
        if node is not self.root and match.num_last_node_pages < len(node.page_ids):
            node = self._split(node, match.num_last_node_pages)
        self.inc_lock_ref(node)
        return node

    def insert(self, token_ids: list[int], page_ids: list[int]) -> int:
        """Cache `token_ids` (a whole number of pages) held by `page_ids`; returns how many of
        its leading tokens were already cached (their pages stay with the caller)."""
        return self._insert(token_ids, page_ids, len(token_ids), self.root, 0)[0]

    def extend(
        self, token_ids: list[int], page_ids: list[int], num_own_pages: int, node: RadixNode
    ) -> RadixNode | None:
        """Cache the written whole pages of a sequence that is still running.

        The first `num_own_pages` pages of `page_ids` must already be the tree's, and `node` is
        the caller's locked node covering them. Returns the node that ends exactly at
        `len(token_ids)`: the caller locks it and then unlocks `node` (it may be `node` itself,
        lengthened in place). Returns None, inserting nothing, when the tree holds more of
        `token_ids` than `num_own_pages` pages: someone else cached those tokens first, so the
        caller's pages for them are duplicates. They cannot be swapped for the tree's while the
        workers read them through the caller's page table, so the caller keeps its own pages
        and gives them back when it ends.
        """
        own_len = num_own_pages * self.page_size
        if node is self.root or self._end_of(node) != own_len:
            # Matched only partly at admission: find the end of the own pages from the root.
            num_cached, last = self._insert(token_ids, page_ids, own_len, self.root, 0)
            return last if num_cached == own_len else None
        if not node.children and node.lock_ref == 1:
            # A running sequence's own leaf, locked by it alone: grow it rather than hang one
            # node per page below it, which would make every later walk and lock change over
            # the sequence longer. A leaf others lock too (requests that matched it, or that
            # computed the same tokens and hold their own copies) is not grown: their locks
            # would then protect pages they do not use, which a request running alone may need
            # (the new pages go in a child below it).
            new_page_ids = page_ids[num_own_pages:]
            node.key.extend(token_ids[own_len:])
            node.page_ids.extend(new_page_ids)
            self._touch(node, next(self._clock))
            if node.lock_ref > 0:
                self._num_protected += len(new_page_ids)
            else:
                self._num_evictable += len(new_page_ids)
            return node
        # Only what lies below `node` can hold more of the sequence: walk from there.
        num_cached, last = self._insert(token_ids, page_ids, own_len, node, own_len)
        return last if num_cached == own_len else None

    def _end_of(self, node: RadixNode) -> int:
        """How many tokens the path from the root to the end of `node` holds."""
        length = 0
        while node is not self.root:
            length += len(node.key)
            assert node.parent is not None
            node = node.parent
        return length

    def _insert(
        self,
        token_ids: list[int],
        page_ids: list[int],
        max_cached_len: int,
        node: RadixNode,
        start: int,
    ) -> tuple[int, RadixNode]:
        """Insert below `node`, which ends at `start`, unless more than `max_cached_len`
        leading tokens are cached already.

        Returns (cached leading tokens, the node ending at `len(token_ids)`); when refused, the
        count is only known to exceed `max_cached_len` and nothing has changed.
        """
        size = self.page_size
        if len(token_ids) != len(page_ids) * size:
            raise ValueError(
                f"{len(token_ids)} tokens do not fill {len(page_ids)} pages of {size}"
            )
        now = next(self._clock)
        while start < len(token_ids):
            key = self._page_key(token_ids, start)
            child = node.children.get(key)
            if child is None:
                leaf = RadixNode(token_ids[start:], page_ids[start // size :], node)
                leaf.last_access = now
                node.children[key] = leaf
                self._leaves.discard(node)  # no longer a leaf
                # No holder sits below a new leaf, so its pages start out evictable.
                self._num_evictable += len(leaf.page_ids)
                self._leaves.push(leaf)
                return start, leaf
            self._touch(child, now)
            count = self._common_pages(child, token_ids, start)
            if start + count * size > max_cached_len:
                return start + count * size, child  # refused: no need to split anything
            if count < len(child.page_ids):
                child = self._split(child, count)
            start += count * size
            node = child
        return start, node

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut `node` after `num_pages` pages; returns the new upper half.

        The `node` object keeps the lower half, so holders of a lock on it stay valid, and the
        upper half inherits its lock count (every holder below `node` is below the new parent).
        """
        cut = num_pages * self.page_size
        parent = node.parent
        assert parent is not None
        upper = RadixNode(node.key[:cut], node.page_ids[:num_pages], parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        parent.children[self._page_key(node.key, 0)] = upper
        node.key = node.key[cut:]
        node.page_ids = node.page_ids[num_pages:]
        node.parent = upper
        upper.children[self._page_key(node.key, 0)] = node
        return upper

    def _touch(self, node: RadixNode, now: int) -> None:
        """`node` was used at `now`: an evictable leaf moves to the back of the queue."""
        node.last_access = now
        if node in self._leaves:
            self._leaves.push(node)

    def inc_lock_ref(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction (one more holder)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._num_evictable -= len(node.page_ids)
                self._num_protected += len(node.page_ids)
                self._leaves.discard(node)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def dec_lock_ref(self, node: RadixNode) -> None:
        """Undo one `inc_lock_ref(node)`."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise ValueError("dec_lock_ref without a matching inc_lock_ref")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_protected -= len(node.page_ids)
                self._num_evictable += len(node.page_ids)
                if not node.children:
                    self._leaves.push(node)
            assert node.parent is not None
            node = node.parent

    def evict(self, num_pages: int) -> list[int]:
        """Remove up to `num_pages` pages from least recently used unlocked leaves.

        A leaf loses pages from its tail first; a leaf left empty is removed, and its parent may
        become an evictable leaf in turn. Returns the freed page ids (fewer than asked when
        nothing else is evictable). O(log n) per leaf it touches.
        """
        freed: list[int] = []
        while len(freed) < num_pages:
            leaf = self._leaves.first()
            if leaf is None:
                break
            take = min(num_pages - len(freed), len(leaf.page_ids))
            self._num_evictable -= take
            if take < len(leaf.page_ids):
                freed.extend(leaf.page_ids[-take:])
                del leaf.page_ids[-take:]
                del leaf.key[-take * self.page_size :]
                break  # the leaf stays, shorter, at the same place in the queue
            freed.extend(leaf.page_ids)
            self._leaves.discard(leaf)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._page_key(leaf.key, 0)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._leaves.push(parent)
        return freed

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the root (for checks and tests; walks the whole tree)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_page_ids(self) -> list[int]:
        """Every page the tree holds (for checks and tests; walks the whole tree)."""
        return [page_id for node in self.nodes() for page_id in node.page_ids]

    def evictable_leaves(self) -> list[RadixNode]:
        """The leaves `evict` may take from, as its queue holds them (for checks and tests)."""
        return self._leaves.nodes()
