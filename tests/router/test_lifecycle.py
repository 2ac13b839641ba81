"""The request lifecycle: every move between waiting, running and ended, its pages and releases."""

from __future__ import annotations

import pytest

from router_service.core.lifecycle import Lifecycle
from router_service.core.page_manager import PageManager
from router_service.core.request import FinishReason, Request
from router_service.core.stats import SchedulerStats

PAGE_SIZE = 4


def admitted(lifecycle: Lifecycle, request: Request, num_tokens: int) -> None:
    """Admit `request` with pages for `num_tokens` tokens, as the step builder does, and mark
    them written (as if their step had run)."""
    pages = lifecycle.pages
    match = pages.cache.match_prefix(request.token_ids[:-1])
    assert pages.admit(request, match, num_tokens, num_spare_pages=0)
    lifecycle.start(request, match.matched_len)
    request.num_computed = match.matched_len + num_tokens
    request.on_workers = True


def test_queue_start_retract_end_move_requests_and_pages() -> None:
    stats = SchedulerStats()
    lifecycle = Lifecycle(PageManager(16, PAGE_SIZE), stats)
    first = Request("a", list(range(3, 13)), max_tokens=4)
    second = Request("b", list(range(3, 13)) + [40], max_tokens=4)
    lifecycle.queue(first)
    lifecycle.queue(second)
    assert (first.arrival, second.arrival) == (0, 1)
    assert lifecycle.waiting == [first, second] and stats.prompt_tokens == 21

    admitted(lifecycle, first, 10)
    assert lifecycle.running == [first] and lifecycle.waiting == [second]
    assert first.admitted_at == 0 and first.num_cached_tokens == 0
    assert lifecycle.take_releases() == []

    # Retracted: back to the queue, its two written whole pages cached, the rest freed.
    lifecycle.retract(first)
    assert lifecycle.running == [] and lifecycle.waiting == [second, first]
    assert first.admitted_at == -1 and first.num_computed == 0 and first.page_table == []
    assert stats.num_retractions == 1
    assert lifecycle.pages.cache.evictable_size == 2
    assert lifecycle.pages.allocator.num_free == 14
    assert lifecycle.take_releases() == ["a"] and lifecycle.take_releases() == []

    # The second request matches the pages the first left in the cache.
    admitted(lifecycle, second, 3)
    assert second.num_cached_tokens == 8 and stats.cache_hit_tokens == 8
    assert lifecycle.pages.cache.protected_size == 2

    second.finish_reason = FinishReason.STOP
    lifecycle.end(second)
    assert lifecycle.running == [] and second.last_node is None
    assert lifecycle.pages.cache.protected_size == 0
    assert lifecycle.take_releases() == ["b"]
    assert lifecycle.pages.audit([]) == []


def test_cancel_ends_once_and_failures_collect_what_the_workers_know() -> None:
    lifecycle = Lifecycle(PageManager(16, PAGE_SIZE), SchedulerStats())
    waiting = Request("w", [3, 4, 5], max_tokens=2)
    running = Request("r", [6, 7, 8, 9, 10], max_tokens=2)
    lifecycle.queue(waiting)
    lifecycle.queue(running)
    admitted(lifecycle, running, 5)

    assert lifecycle.cancel(waiting) and waiting.finish_reason is FinishReason.CANCELLED
    assert not lifecycle.cancel(waiting)
    assert lifecycle.waiting == [] and lifecycle.take_releases() == []  # never on the workers

    assert lifecycle.fail_running_without_pages() == [running]
    assert running.finish_reason is FinishReason.FAILED and lifecycle.running == []
    assert lifecycle.take_releases() == ["r"]
    lifecycle.restore_releases(["x"])
    assert lifecycle.take_releases() == ["x"]

    late = Request("late", [3, 4], max_tokens=2)
    lifecycle.queue(late)
    lifecycle.fail_waiting(late)
    assert late.finish_reason is FinishReason.FAILED and lifecycle.waiting == []
    with pytest.raises(ValueError):
        lifecycle.fail_waiting(late)  # no longer waiting


def test_fail_all_ends_everyone_without_releases() -> None:
    lifecycle = Lifecycle(PageManager(16, PAGE_SIZE), SchedulerStats())
    requests = [Request(name, [3, 4, 5], max_tokens=2) for name in "abc"]
    for request in requests:
        lifecycle.queue(request)
    admitted(lifecycle, requests[0], 3)
    assert sorted(r.request_id for r in lifecycle.fail_all()) == ["a", "b", "c"]
    assert all(r.finish_reason is FinishReason.FAILED for r in requests)
    assert lifecycle.running == lifecycle.waiting == [] and lifecycle.take_releases() == []
