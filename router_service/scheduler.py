"""The continuous-batching scheduler: which tokens of which requests run in the next step.

Plain Python over ints and lists. Each `schedule()` builds one step within `max_batch_tokens`:
1. running requests that decode (one pending token) first, in admission order (when there are
   more than the budget, the oldest go first; the others wait for them to end); a decode that
   needs a page it cannot get even after eviction retracts the most recently admitted request
   (the one that loses the least work) back to the queue;
2. running requests still in the middle of a chunked prefill, as far as budget and pages allow;
3. waiting requests, in policy order (`lpm`: longest cached prefix first; `fcfs`: arrival),
   admitted while running slots, budget and pages (after eviction) last. A prefill longer than
   the remaining budget is cut into chunks computed over several steps. A waiting request whose
   prompt shares at least one page more with a request still prefilling than with the cache is
   deferred (see `queue_order.defers`), so that a burst sharing an uncached prefix computes it once.
`complete(plan, token_ids)` applies the sampled tokens. A running request's pages go into the
radix cache as soon as they are written whole (after a prefill chunk, or when decode fills a
page), still locked for it, so that others match them while it runs; a request that ends (or is
retracted) gives its remaining written whole pages to the cache, releases its lock and frees the
rest.
"""

from __future__ import annotations

import itertools
import logging

from router_service.errors import InvalidRequest
from router_service.page_allocator import PageAllocator
from router_service.page_audit import audit_pages
from router_service.page_handoff import cache_written_pages, give_back_pages
from router_service.queue_order import Policy, defers, in_policy_order
from router_service.radix_cache import MatchResult, RadixCache
from router_service.request import FinishReason, Request
from router_service.step_plan import ScheduledEntry, SchedulerStats, StepPlan

log = logging.getLogger(__name__)

# Eviction walks the tree's leaves; freeing this share of the pool at once (rather than the one
# page a decode needs) keeps that walk off most steps once the cache has filled the pool.
EVICT_BATCH_FRACTION = 1 / 256


class Scheduler:
    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        max_batch_tokens: int,
        max_running_requests: int,
        policy: Policy,
        context_len: int,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.page_size = page_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running_requests = max_running_requests
        self.policy = policy
        self.context_len = context_len
        self.eos_token_ids = eos_token_ids
        self.allocator = PageAllocator(num_pages)
        self._evict_batch = max(1, int(num_pages * EVICT_BATCH_FRACTION))
        self.cache = RadixCache(page_size)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order
        self.stats = SchedulerStats()
        self._releases: list[str] = []
        self._arrivals = itertools.count()
        self._admissions = itertools.count()

    # ---- requests in and out -------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request; raises `InvalidRequest` when it could never run to its end alone.

        A request is accepted only if the whole pool holds its longest possible sequence (prompt
        plus `max_tokens`, capped by the context; the last token's K/V is never written). Then
        it can always finish: other requests can make it wait or retract it, never cut it short.
        """
        if request.num_prompt >= self.context_len:
            raise InvalidRequest(
                f"prompt of {request.num_prompt} tokens leaves no room in the context of "
                f"{self.context_len}"
            )
        final_len = min(request.num_prompt + request.max_tokens, self.context_len)
        need = self._num_pages_for(final_len - 1)
        if need > self.allocator.num_pages:
            raise InvalidRequest(
                f"prompt of {request.num_prompt} tokens plus max_tokens {request.max_tokens} "
                f"needs {need} KV pages of {self.page_size} tokens; the pool holds "
                f"{self.allocator.num_pages} pages"
            )
        request.arrival = next(self._arrivals)
        self.stats.prompt_tokens += request.num_prompt
        self.waiting.append(request)

    def cancel(self, request: Request) -> bool:
        """End a waiting or running request now; False when it had already ended."""
        if request.finish_reason is not None:
            return False
        if request.admitted_at < 0:
            self.waiting.remove(request)
            request.finish_reason = FinishReason.CANCELLED
        else:
            request.finish_reason = FinishReason.CANCELLED
            self._end(request)
        return True

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- planning a step -----------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_batch_tokens
        scheduled: set[int] = set()
        # Requests whose prefill runs in this step or later: their pages are not cached yet.
        prefilling = [request for request in self.running if request.num_pending > 1]
        for request in list(self.running):
            if budget == 0:
                break
            if request.admitted_at < 0 or request.num_pending != 1:
                continue  # retracted just now, or still prefilling
            if not self._grow_for_decode(request, plan):
                continue
            plan.entries.append(self._entry(request, 1, new_request=False))
            scheduled.add(id(request))
            budget -= 1
        for request in list(self.running):
            if budget == 0:
                break
            if id(request) in scheduled or request.num_pending == 0:
                continue
            num_tokens = self._fit_chunk(request, min(request.num_pending, budget))
            if num_tokens == 0:
                continue
            plan.entries.append(self._entry(request, num_tokens, new_request=False))
            scheduled.add(id(request))
            budget -= num_tokens
        deferred = self._admit_waiting(plan, budget, prefilling)
        if deferred and not plan.entries:
            # Deferring must not leave a step idle (the prefill it waits on may be stuck
            # for pages): admit without it rather than compute nothing.
            self._admit_waiting(plan, budget, None)
        if not plan.entries and self.running:
            # Every running request is stuck in a prefill with no page to grow into:
            # give one request's pages back so that the others can go on next step.
            self._retract(self.running[-1])
        plan.release_request_ids = self._releases
        self._releases = []
        return plan

    def _num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _reserve(self, num_pages: int) -> bool:
        """Make `num_pages` pages free, evicting cached pages if needed."""
        short = num_pages - self.allocator.num_free
        if short > 0:
            self.allocator.free(self.cache.evict(max(short, self._evict_batch)))
        return self.allocator.num_free >= num_pages

    def _grow_for_decode(self, request: Request, plan: StepPlan) -> bool:
        """Give `request` a page for its next token, retracting others if need be.

        False when `request` itself was retracted (or ended because it cannot fit alone).
        """
        need = self._num_pages_for(request.num_computed + 1) - len(request.page_table)
        if need <= 0:
            return True
        while not self._reserve(need):
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:
                # `add` let in only requests that fit the pool alone: pages went missing.
                log.error("BUG: %s runs alone and finds no page for position %d; failing it",
                          request.request_id, request.num_computed)
                request.finish_reason = FinishReason.FAILED
                self._end(request)
                plan.ended.append(request)
                return False
            self._retract(victim)
            if victim is request:
                return False
        request.page_table.extend(self.allocator.alloc(need))
        return True

    def _fit_chunk(self, request: Request, num_tokens: int) -> int:
        """Shrink a prefill chunk to the pages that can be had; allocates them."""
        available = self.allocator.num_free + self.cache.evictable_size
        room = (len(request.page_table) + available) * self.page_size - request.num_computed
        num_tokens = min(num_tokens, room)
        if num_tokens <= 0:
            return 0
        need = self._num_pages_for(request.num_computed + num_tokens) - len(request.page_table)
        if need > 0:
            self._reserve(need)
            request.page_table.extend(self.allocator.alloc(need))
        return num_tokens

    def _admit_waiting(
        self, plan: StepPlan, budget: int, prefilling: list[Request] | None
    ) -> bool:
        """Admit waiting requests into `plan` within `budget`; True when one was deferred.

        `prefilling` (None: defer nothing) are the running requests whose prefill is not cached
        yet; requests admitted here join it, since their pages are cached only after the step.
        """
        deferred = False
        if budget == 0 or not self.waiting or len(self.running) >= self.max_running_requests:
            return deferred
        for request in in_policy_order(self.waiting, self.policy, self.cache):
            if budget == 0 or len(self.running) >= self.max_running_requests:
                break
            tokens = request.token_ids
            # Leave at least the last token to compute: its logits give the next token.
            match = self.cache.match_prefix(tokens[: len(tokens) - 1])
            if prefilling is not None and defers(request, match.matched_len, prefilling, self.page_size):
                deferred = True
                continue  # not short of pages: the ones behind it may go
            entry = self._admit(request, match, budget)
            if entry is None:
                break  # keep the order: nothing behind it jumps ahead for pages
            plan.entries.append(entry)
            budget -= len(entry.token_ids)
            if prefilling is not None:
                prefilling.append(request)
        return deferred

    def _admit(self, request: Request, match: MatchResult, budget: int) -> ScheduledEntry | None:
        """Start (or resume) `request` with its first chunk, or None when pages are short.

        `match` is the cache's match of all but the last token, not yet locked.
        """
        tokens = request.token_ids
        locked = self.cache.lock(match)
        num_matched_pages = len(match.page_ids)
        num_pages_total = min(self._num_pages_for(len(tokens) + 1), self.allocator.num_pages)
        need_total = num_pages_total - num_matched_pages
        # Keep a page of headroom per running request, so that admitting does not make the
        # running ones retract at their next page boundary.
        headroom = len(self.running)
        if self.allocator.num_free + self.cache.evictable_size < need_total + headroom:
            self.cache.dec_lock_ref(locked)
            return None
        num_tokens = min(len(tokens) - match.matched_len, budget)
        need_now = self._num_pages_for(match.matched_len + num_tokens) - num_matched_pages
        self._reserve(need_now)
        request.page_table = match.page_ids + self.allocator.alloc(need_now)
        request.num_tree_pages = num_matched_pages
        request.last_node = locked
        request.num_computed = match.matched_len
        request.num_pages_sent = 0
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = match.matched_len
            self.stats.cache_hit_tokens += match.matched_len
        request.admitted_at = next(self._admissions)
        self.waiting.remove(request)
        self.running.append(request)
        return self._entry(request, num_tokens, new_request=True)

    def _entry(self, request: Request, num_tokens: int, *, new_request: bool) -> ScheduledEntry:
        start = request.num_computed
        entry = ScheduledEntry(
            request=request,
            token_ids=request.token_ids[start : start + num_tokens],
            start_position=start,
            new_page_ids=request.page_table[request.num_pages_sent :],
            sample=start + num_tokens == len(request.token_ids),
            new_request=new_request,
            cached_token_ids=request.token_ids[:start] if new_request else [],
        )
        request.num_pages_sent = len(request.page_table)
        request.num_computed = start + num_tokens
        request.on_workers = True
        return entry

    # ---- applying a step -----------------------------------------------------------------

    def complete(self, plan: StepPlan, token_ids: list[int]) -> list[Request]:
        """Apply the sampled tokens (one per sampling entry, in entry order).

        Returns the requests that got a token, in entry order; ended ones have their
        `finish_reason` set and their pages already given back.
        """
        sampling = [entry for entry in plan.entries if entry.sample]
        if len(sampling) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens for {len(sampling)} sampling entries")
        self.stats.num_steps += 1
        updated: list[Request] = []
        for entry, token_id in zip(sampling, token_ids):
            request = entry.request
            if request.finish_reason is not None:
                continue
            request.append_token(token_id, self.eos_token_ids, self.context_len)
            updated.append(request)
            if request.finish_reason is not None:
                self._end(request)
        size = self.page_size
        for entry in plan.entries:
            request = entry.request
            if request.finish_reason is not None or request.admitted_at < 0:
                continue  # ended (its pages are given back) or retracted
            # Only when this step filled a page: most decode steps cost one comparison here.
            end = entry.start_position + len(entry.token_ids)
            if end // size > entry.start_position // size:
                cache_written_pages(self.cache, request)
        return updated

    # ---- giving pages back ---------------------------------------------------------------

    def _end(self, request: Request) -> None:
        """A running request is done (finish_reason set): cache, unlock and free its pages."""
        self.running.remove(request)
        self._give_back_pages(request)

    def _retract(self, request: Request) -> None:
        """Send a running request back to the queue; its written pages stay in the cache."""
        self.running.remove(request)
        self._give_back_pages(request)
        request.admitted_at = -1
        request.num_computed = 0
        self.waiting.append(request)
        self.stats.num_retractions += 1

    def _give_back_pages(self, request: Request) -> None:
        give_back_pages(self.cache, self.allocator, request)
        if request.on_workers:
            self._releases.append(request.request_id)
            request.on_workers = False

    def audit_when_idle(self) -> list[Request]:
        """Check the page bookkeeping and progress; the engine calls this when a plan is empty.

        Inconsistent pages (see `page_audit`; logged loudly) fail the running requests, whose
        page tables can no longer be trusted, drop the cache and start the pool over all free;
        waiting requests stay queued and are computed afresh. A queue with nothing running
        that still admits nothing breaks the progress guarantee: its head request fails.
        Returns the requests that failed (FAILED set; their releases go with the next plan).
        """
        problems = audit_pages(self.allocator, self.cache, self.running)
        if problems:
            self.stats.num_audit_failures += 1
            log.error("BUG: KV page bookkeeping is inconsistent (%s); failing %d running "
                      "request(s) and dropping the prefix cache", "; ".join(problems),
                      len(self.running))
            failed = list(self.running)
            for request in failed:
                request.finish_reason = FinishReason.FAILED
                if request.on_workers:
                    self._releases.append(request.request_id)
            self.running.clear()
            self.allocator = PageAllocator(self.allocator.num_pages)
            self.cache = RadixCache(self.page_size)
            return failed
        if self.waiting and not self.running:
            head = in_policy_order(self.waiting, self.policy, self.cache)[0]
            self.stats.num_audit_failures += 1
            log.error("BUG: nothing runs and %s (%d tokens) is not admitted; failing it",
                      head.request_id, len(head.token_ids))
            self.waiting.remove(head)
            head.finish_reason = FinishReason.FAILED
            return [head]
        return []

    def fail_step(self, plan: StepPlan) -> list[Request]:
        """Every rank rejected `plan`'s task, applying none of it: fail the requests in it.

        Their pages past the cached ones may hold partial writes of that step: none of those
        enter the cache; cached pages were written by earlier steps and stay trusted. The
        task's releases go again with the next plan. Returns the failed requests.
        """
        self._releases = plan.release_request_ids + self._releases
        failed = []
        for entry in plan.entries:
            request = entry.request
            if request.finish_reason is not None or request.admitted_at < 0:
                continue
            request.finish_reason = FinishReason.FAILED
            request.num_computed = request.num_tree_pages * self.page_size
            self._end(request)
            failed.append(request)
        return failed

    def fail_all(self) -> list[Request]:
        """End every request (the workers failed): returns them, with FAILED set.

        Nothing goes into the cache: the workers' K/V can no longer be trusted.
        """
        ended = [*self.running, *self.waiting]
        for request in ended:
            request.finish_reason = FinishReason.FAILED
        self.running.clear()
        self.waiting.clear()
        return ended
