"""Pages changing hands between a request and the prefix cache: written whole pages enter the
cache while the request runs, and everything comes back when it ends or is retracted."""

from __future__ import annotations

from router_service.page_allocator import PageAllocator
from router_service.radix_cache import RadixCache
from router_service.request import Request


def cache_written_pages(cache: RadixCache, request: Request) -> None:
    """Put a running request's written whole pages in the cache, moving its lock to them.

    When the cache already holds some of those tokens from another request (both computed
    them), nothing is inserted: the request keeps its duplicate pages (the workers read them
    through its page table) until it ends, when `give_back_pages` frees them.
    """
    num_full = request.num_computed // cache.page_size
    if num_full <= request.num_tree_pages:
        return
    assert request.last_node is not None  # set at admission
    node = cache.extend(
        request.token_ids[: num_full * cache.page_size],
        request.page_table[:num_full],
        request.num_tree_pages,
        request.last_node,
    )
    if node is None:
        return
    if node is not request.last_node:
        # Lock the new node before unlocking the old one: no page is evictable between.
        cache.inc_lock_ref(node)
        cache.dec_lock_ref(request.last_node)
        request.last_node = node
    request.num_tree_pages = num_full


def give_back_pages(cache: RadixCache, allocator: PageAllocator, request: Request) -> None:
    """A request ends or is retracted: its written whole pages go to the cache, its lock is
    released, and the rest of its pages (unwritten tail, duplicates of cached ones) are freed.

    The caller tells the workers to forget the request.
    """
    # Only positions whose K/V was written count; the last sampled token's was not.
    num_full = request.num_computed // cache.page_size
    table = request.page_table
    free_ids = table[num_full:]
    if num_full > request.num_tree_pages:
        tokens = request.token_ids[: num_full * cache.page_size]
        num_cached = cache.insert(tokens, table[:num_full]) // cache.page_size
        # Pages the tree already had from someone else: ours are duplicates.
        free_ids += table[request.num_tree_pages : num_cached]
    allocator.free(free_ids)
    if request.last_node is not None:
        cache.dec_lock_ref(request.last_node)
    request.page_table = []
    request.num_tree_pages = 0
    request.last_node = None
    request.num_pages_sent = 0
