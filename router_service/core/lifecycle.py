"""The request lifecycle: every move of a request between waiting, running and ended.

```
          queue           start                  end (finished, cancelled, failed)
 (new) ─────────▶ waiting ──────▶ running ──────────────────────────────────────▶ (ended)
                     ▲               │
                     └── retract ────┘  (pages short: back to the queue, written pages cached)
```

`Lifecycle` owns the waiting and running lists and is the only code that changes them. The
step builder is given it to admit (`start`), retract and end requests while it plans a step;
the scheduler uses it to queue, cancel, end finished requests and fail them. Leaving the
running list always gives the request's pages back through the `PageManager` (written whole
pages to the cache, the rest freed) and, when the workers know the request, collects its id
for the next step's releases (`take_releases`).

Invariants: a request is in at most one of `waiting` and `running`; `running` is in admission
order (`admitted_at` increasing) and its requests hold pages, waiting ones hold none
(`admitted_at == -1`); an ended request has `finish_reason` set and is in neither.
"""

from __future__ import annotations

import itertools

from router_service.core.page_manager import PageManager
from router_service.core.request import FinishReason, Request
from router_service.core.stats import SchedulerStats


class Lifecycle:
    def __init__(self, pages: PageManager, stats: SchedulerStats) -> None:
        self.pages = pages
        self.stats = stats
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order
        self._releases: list[str] = []
        self._arrivals = itertools.count()
        self._admissions = itertools.count()

    def queue(self, request: Request) -> None:
        """A new request joins the waiting queue (the caller checked that it can ever run)."""
        request.arrival = next(self._arrivals)
        self.stats.prompt_tokens += request.num_prompt
        self.waiting.append(request)

    def start(self, request: Request, matched_len: int) -> None:
        """A waiting request was admitted (its pages are in place): it runs from now on."""
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = matched_len
            self.stats.cache_hit_tokens += matched_len
        request.admitted_at = next(self._admissions)
        self.waiting.remove(request)
        self.running.append(request)

    def retract(self, request: Request) -> None:
        """Send a running request back to the queue; its written pages stay in the cache."""
        self.running.remove(request)
        self._give_back_pages(request)
        request.admitted_at = -1
        request.num_computed = 0
        self.waiting.append(request)
        self.stats.num_retractions += 1

    def end(self, request: Request) -> None:
        """A running request is done (`finish_reason` set): cache, unlock and free its pages."""
        self.running.remove(request)
        self._give_back_pages(request)

    def cancel(self, request: Request) -> bool:
        """End a waiting or running request now; False when it had already ended."""
        if request.finish_reason is not None:
            return False
        request.finish_reason = FinishReason.CANCELLED
        if request.admitted_at < 0:
            self.waiting.remove(request)
        else:
            self.end(request)
        return True

    def fail_waiting(self, request: Request) -> None:
        """A waiting request can never be admitted: it ends FAILED (it holds no pages)."""
        self.waiting.remove(request)
        request.finish_reason = FinishReason.FAILED

    def fail_running_without_pages(self) -> list[Request]:
        """Every running request ends FAILED without giving pages back (their page tables can no
        longer be trusted: the caller starts the pool over). Returns them."""
        failed = list(self.running)
        for request in failed:
            request.finish_reason = FinishReason.FAILED
            if request.on_workers:
                self._releases.append(request.request_id)
        self.running.clear()
        return failed

    def fail_all(self) -> list[Request]:
        """Every request ends FAILED (the workers failed): returns them.

        Nothing goes into the cache and no release is collected: the connection to the workers
        starts over, and their K/V can no longer be trusted.
        """
        ended = [*self.running, *self.waiting]
        for request in ended:
            request.finish_reason = FinishReason.FAILED
        self.running.clear()
        self.waiting.clear()
        return ended

    def take_releases(self) -> list[str]:
        """The ids the workers must forget, collected since the last call."""
        releases, self._releases = self._releases, []
        return releases

    def restore_releases(self, request_ids: list[str]) -> None:
        """Releases that did not reach the workers (their task was rejected) go again first."""
        self._releases = request_ids + self._releases

    def _give_back_pages(self, request: Request) -> None:
        # Work still in flight for it is stale from here on (see `Scheduler.complete`).
        self.pages.give_back(request)
        request.num_computed = request.num_written
        request.num_in_flight = 0
        request.num_unresolved = 0
        if request.on_workers:
            self._releases.append(request.request_id)
            request.on_workers = False
