"""The scheduler's page bookkeeping, checked whole: run whenever the scheduler goes idle.

Every page is in exactly one place: the allocator's free list, the radix cache, or the
unshared tail of one running request's page table (`page_table[num_tree_pages:]`). A running
request's first `num_tree_pages` pages must be the cache's. Any violation is a router bug; it
must be found while it can still be contained (before a freed page is handed out twice and one
request's K/V overwrites another's).
"""

from __future__ import annotations

from collections import Counter

from router_service.page_allocator import PageAllocator
from router_service.radix_cache import RadixCache
from router_service.request import Request


def audit_pages(allocator: PageAllocator, cache: RadixCache, running: list[Request]) -> list[str]:
    """What is wrong with the page bookkeeping (empty when it is consistent). Walks the whole
    tree and every page table: O(pages), meant for idle moments."""
    problems: list[str] = []
    tree_ids = cache.all_page_ids()
    owned_ids = [page for request in running for page in request.page_table[request.num_tree_pages :]]
    num_free = allocator.num_free
    if num_free + len(tree_ids) + len(owned_ids) != allocator.num_pages:
        problems.append(
            f"{num_free} free + {len(tree_ids)} cached + {len(owned_ids)} owned pages "
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
    return problems
