"""KV page bookkeeping: which pages each running request holds, and which the prefix cache keeps.

The `PageManager` owns the page allocator and the radix cache, and is the only code that moves
pages between them and the requests:
- `admit` hands a request the cache's pages for its matched prefix (locked) and new pages for
  its first chunk, or refuses when the pool could not hold the rest of its prompt;
- `room` and `grow` extend a running request's page table for its next tokens, evicting exactly
  the cached pages that are short (`reserve`);
- `cache_written` puts a running request's written whole pages in the cache at once, so that
  others match them while it runs;
- `give_back` returns everything when a request ends or is retracted: written whole pages to the
  cache, the lock released, the rest freed.

Invariants (checked whole by `audit`, when the scheduler is idle): every page is in exactly one
place, the allocator's free list, the radix cache, or the unshared tail of one running request's
page table (`page_table[num_tree_pages:]`); a running request's first `num_tree_pages` pages are
the cache's, locked through its `last_node`; the cache's eviction queue holds exactly its
unlocked leaves. A violation is a router bug: it must be found while it can still be contained,
before a freed page is handed out twice and one request's K/V overwrites another's.
"""

from __future__ import annotations

from collections import Counter

from router_service.core.page_allocator import PageAllocator
from router_service.core.radix_cache import MatchResult, RadixCache
from router_service.core.request import Request


class PageManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(page_size)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_available(self) -> int:
        """Pages that can be had now: free, or held only by the cache (evictable)."""
        return self.allocator.num_free + self.cache.evictable_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def reserve(self, num_pages: int) -> bool:
        """Make `num_pages` pages free, evicting exactly the cached pages that are short."""
        short = num_pages - self.allocator.num_free
        if short > 0:
            self.allocator.free(self.cache.evict(short))
        return self.allocator.num_free >= num_pages

    def room(self, request: Request) -> int:
        """How many tokens past `num_computed` the request's page table could grow to hold."""
        return (len(request.page_table) + self.num_available) * self.page_size - request.num_computed

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Extend `request`'s page table to hold its next `num_tokens` tokens; False (taking
        nothing) when the pages cannot be had even after eviction."""
        # `pages_for`, inline: most calls are a decode whose page has room, on every step.
        need = -(-(request.num_computed + num_tokens) // self.page_size) - len(request.page_table)
        if need <= 0:
            return True
        if not self.reserve(need):
            return False
        request.page_table.extend(self.allocator.alloc(need))
        return True

    def admit(self, request: Request, match: MatchResult, num_tokens: int, num_spare_pages: int) -> bool:
        """Start `request` on the cache's pages for `match` and pages for its first `num_tokens`.

        `match` is the cache's match of all but the last token, fresh (nothing changed the tree
        since), not yet locked. False, taking no page, when the pool could not hold the rest
        of its prompt plus `num_spare_pages`.
        """
        locked = self.cache.lock(match)
        num_matched_pages = len(match.page_ids)
        num_pages_total = min(self.pages_for(len(request.token_ids) + 1), self.num_pages)
        if self.num_available < num_pages_total - num_matched_pages + num_spare_pages:
            self.cache.dec_lock_ref(locked)
            return False
        request.page_table = list(match.page_ids)
        request.num_tree_pages = num_matched_pages
        request.last_node = locked
        request.num_computed = match.matched_len
        request.num_pages_sent = 0
        self.grow(request, num_tokens)  # fits: it is part of the prompt checked above
        return True

    def cache_written(self, request: Request) -> None:
        """Put a running request's written whole pages in the cache, moving its lock to them.

        When the cache already holds some of those tokens from another request (both computed
        them), nothing is inserted: the request keeps its duplicate pages (the workers read them
        through its page table) until it ends, when `give_back` frees them.
        """
        num_full = request.num_written // self.page_size
        if num_full <= request.num_tree_pages:
            return
        assert request.last_node is not None  # set at admission
        node = self.cache.extend(
            request.token_ids[: num_full * self.page_size],
            request.page_table[:num_full],
            request.num_tree_pages,
            request.last_node,
        )
        if node is None:
            return
        if node is not request.last_node:
            # Lock the new node before unlocking the old one: no page is evictable between.
            self.cache.inc_lock_ref(node)
            self.cache.dec_lock_ref(request.last_node)
            request.last_node = node
        request.num_tree_pages = num_full

    def give_back(self, request: Request) -> None:
        """A request ends or is retracted: its written whole pages go to the cache, its lock is
        released, and the rest of its pages (unwritten tail, duplicates of cached ones) are
        freed. The caller tells the workers to forget the request."""
        # Only positions whose K/V was written count (not the last sampled token's, not those of
        # a step still in flight, which the request no longer owns).
        num_full = request.num_written // self.page_size
        table = request.page_table
        free_ids = table[num_full:]
        if num_full > request.num_tree_pages:
            tokens = request.token_ids[: num_full * self.page_size]
            num_cached = self.cache.insert(tokens, table[:num_full]) // self.page_size
            # Pages the tree already had from someone else: ours are duplicates.
            free_ids += table[request.num_tree_pages : num_cached]
        self.allocator.free(free_ids)
        if request.last_node is not None:
            self.cache.dec_lock_ref(request.last_node)
        request.page_table = []
        request.num_tree_pages = 0
        request.last_node = None
        request.num_pages_sent = 0

    def audit(self, running: list[Request]) -> list[str]:
        """What breaks the invariants above (empty when none is broken). Walks the whole tree
        and every page table: O(pages), meant for idle moments."""
        problems: list[str] = []
        allocator, cache = self.allocator, self.cache
        tree_ids = cache.all_page_ids()
        owned_ids = [page for request in running for page in request.page_table[request.num_tree_pages :]]
        if allocator.num_free + len(tree_ids) + len(owned_ids) != allocator.num_pages:
            problems.append(
                f"{allocator.num_free} free + {len(tree_ids)} cached + {len(owned_ids)} owned pages "
                f"!= {allocator.num_pages} in all"
            )
        if len(tree_ids) != cache.total_size:
            problems.append(f"the cache counts {cache.total_size} pages but holds {len(tree_ids)}")
        held = Counter(tree_ids + owned_ids)
        twice = sorted(page for page, count in held.items() if count > 1)
        if twice:
            problems.append(f"pages held twice: {twice[:8]}")
        foreign = sorted(page for page in held if not 0 <= page < allocator.num_pages)
        if foreign:
            problems.append(f"pages outside the pool: {foreign[:8]}")
        free_and_held = sorted(
            page for page in held if 0 <= page < allocator.num_pages and allocator.is_free(page)
        )
        if free_and_held:
            problems.append(f"pages both free and held: {free_and_held[:8]}")
        tree_set = set(tree_ids)
        for request in running:
            missing = [page for page in request.page_table[: request.num_tree_pages] if page not in tree_set]
            if missing:
                problems.append(f"{request.request_id} uses cache pages the cache lacks: {missing[:8]}")
        unlocked_leaves = {node for node in cache.nodes() if node.lock_ref == 0 and not node.children}
        if set(cache.evictable_leaves()) != unlocked_leaves:
            problems.append("the cache's eviction queue is not its set of unlocked leaves")
        return problems

    def drop_all(self) -> None:
        """Start over with every page free and an empty cache (after `audit` found problems)."""
        self.allocator = PageAllocator(self.allocator.num_pages)
        self.cache = RadixCache(self.page_size)
