"""The continuous-batching scheduler: requests in, one step plan out, sampled tokens applied.

The `Scheduler` composes three parts and keeps the requests' lifecycle itself:
- `PageManager` (`page_manager`): the KV page bookkeeping, allocator and radix cache;
- admission (`admission`): the waiting queue's policy order and deferral;
- `StepBuilder` (`step_builder`): which tokens of which requests run in the next step.
It owns the waiting and running requests and every move between them: `add` (queued, once it
is known to fit the pool alone), `start` (admitted), `retract` (back to the queue, pages given
back), `end` (finished, cancelled or failed, pages given back), and collects the ids the
workers must forget. `schedule()` plans a step; `complete(plan, token_ids, num_accepted)` applies
the sampled tokens (after the drafts rank 0 accepted, see `speculation`), ends finished requests
and caches every page the step wrote whole.

Plain Python over ints and lists, like everything it uses: no grpc, no torch.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import astuple, dataclass

from router_service.admission import Policy, in_policy_order
from router_service.errors import InvalidRequest
from router_service.page_allocator import PageAllocator
from router_service.page_manager import PageManager
from router_service.radix_cache import RadixCache
from router_service.request import FinishReason, Request
from router_service.speculation import SpeculationConfig, Speculator
from router_service.step_builder import StepBuilder
from router_service.step_plan import ScheduledEntry, StepPlan

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerStats:
    """Counters since the scheduler began (GetStats adds those of schedulers before it)."""

    num_steps: int = 0
    num_retractions: int = 0
    cache_hit_tokens: int = 0
    prompt_tokens: int = 0
    # Speculative decoding: decode entries that carried drafts, drafts verified, drafts kept.
    num_draft_entries: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    def __add__(self, other: SchedulerStats) -> SchedulerStats:
        return SchedulerStats(*(mine + theirs for mine, theirs in zip(astuple(self), astuple(other))))


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
        speculation: SpeculationConfig | None = None,
    ) -> None:
        """`speculation` None: no drafts (as with `enabled=False`)."""
        self.page_size = page_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running_requests = max_running_requests
        self.policy = policy
        self.context_len = context_len
        self.eos_token_ids = eos_token_ids
        self.pages = PageManager(num_pages, page_size)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order
        self.stats = SchedulerStats()
        self.speculator = Speculator(speculation, context_len) if speculation else None
        self._releases: list[str] = []
        self._arrivals = itertools.count()
        self._admissions = itertools.count()

    @property
    def cache(self) -> RadixCache:
        return self.pages.cache

    @property
    def allocator(self) -> PageAllocator:
        return self.pages.allocator

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

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
        need = self.pages.pages_for(final_len - 1)
        if need > self.pages.num_pages:
            raise InvalidRequest(
                f"prompt of {request.num_prompt} tokens plus max_tokens {request.max_tokens} "
                f"needs {need} KV pages of {self.page_size} tokens; the pool holds "
                f"{self.pages.num_pages} pages"
            )
        request.arrival = next(self._arrivals)
        self.stats.prompt_tokens += request.num_prompt
        self.waiting.append(request)

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

    def schedule(self) -> StepPlan:
        """Plan the next step; it carries the releases collected since the last plan."""
        plan = StepBuilder(self).build()
        plan.release_request_ids = self._releases
        self._releases = []
        return plan

    # ---- applying a step -----------------------------------------------------------------

    def complete(
        self, plan: StepPlan, token_ids: list[int], num_accepted: list[int] | None = None
    ) -> list[Request]:
        """Apply the sampled tokens (one per sampling entry, in entry order).

        `num_accepted[i]` (default 0) is how many of sampling entry i's drafts rank 0 accepted:
        the request's output grows by those drafts, then `token_ids[i]`, cut at the first token
        that ends it. Only positions before the last appended token count as computed, so the
        K/V of rejected drafts (and of a stop token) never enters the cache.
        Returns the requests that got a token, in entry order; ended ones have their
        `finish_reason` set and their pages already given back. Entries that went stale while
        the step was in flight (their request ended or was retracted since: the work planned
        one step ahead under overlap) are discarded: their tokens are never emitted, and what
        they wrote never enters the cache (their pages were given back by `num_written`).
        """
        sampling = [entry for entry in plan.entries if entry.sample]
        if len(sampling) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens for {len(sampling)} sampling entries")
        if num_accepted is None:
            num_accepted = [0] * len(sampling)
        self.stats.num_steps += 1
        for entry in plan.entries:
            if not entry.is_stale:
                entry.request.num_in_flight -= entry.num_tokens
        updated: list[Request] = []
        for entry, token_id, accepted in zip(sampling, token_ids, num_accepted):
            if entry.is_stale:
                continue
            request = entry.request
            request.num_unresolved -= 1
            if entry.num_draft_tokens:
                self._append_verified(entry, token_id, accepted)
            else:
                request.append_token(token_id, self.eos_token_ids, self.context_len)
            updated.append(request)
            if request.finish_reason is not None:
                self.end(request)
        size = self.page_size
        for entry in plan.entries:
            if entry.is_stale:
                continue  # ended (its pages are given back) or retracted
            # Only when this step filled a page: most decode steps cost one comparison here.
            end = entry.start_position + entry.num_tokens
            if entry.num_draft_tokens:
                end = entry.request.num_computed  # the kept positions only
            if end // size > entry.start_position // size:
                self.pages.cache_written(entry.request)
        return updated

    def _append_verified(self, entry: ScheduledEntry, token_id: int, num_accepted: int) -> None:
        """Append a speculative entry's accepted drafts and sampled token, up to a stop."""
        request = entry.request
        num_drafts = entry.num_draft_tokens
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"{num_accepted} drafts accepted of {num_drafts}")
        drafts = entry.token_ids[len(entry.token_ids) - num_drafts:]
        num_appended = 0
        for token in [*drafts[:num_accepted], token_id]:
            request.append_token(token, self.eos_token_ids, self.context_len)
            num_appended += 1
            if request.finish_reason is not None:
                break
        num_used = min(num_appended, num_accepted)  # accepted drafts that became output
        # The last appended token is pending (its K/V is not kept), as after any decode step.
        request.num_computed = len(request.token_ids) - 1
        assert self.speculator is not None  # only a speculator proposes drafts
        request.draft.record(num_drafts, num_used, self.speculator.config)
        self.stats.num_draft_entries += 1
        self.stats.num_draft_tokens += num_drafts
        self.stats.num_accepted_draft_tokens += num_used

    # ---- moving requests between waiting and running -------------------------------------

    def start(self, request: Request, matched_len: int) -> None:
        """A waiting request was admitted (its pages are in place): it runs from now on."""
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = matched_len
            self.stats.cache_hit_tokens += matched_len
        request.admitted_at = next(self._admissions)
        self.waiting.remove(request)
        self.running.append(request)

    def end(self, request: Request) -> None:
        """A running request is done (finish_reason set): cache, unlock and free its pages."""
        self.running.remove(request)
        self._give_back_pages(request)

    def retract(self, request: Request) -> None:
        """Send a running request back to the queue; its written pages stay in the cache."""
        self.running.remove(request)
        self._give_back_pages(request)
        request.admitted_at = -1
        request.num_computed = 0
        self.waiting.append(request)
        self.stats.num_retractions += 1

    def _give_back_pages(self, request: Request) -> None:
        # Work still in flight for it is stale from here on (see `complete`).
        self.pages.give_back(request)
        request.num_computed = request.num_written
        request.num_in_flight = 0
        request.num_unresolved = 0
        if request.on_workers:
            self._releases.append(request.request_id)
            request.on_workers = False

    def audit_when_idle(self) -> list[Request]:
        """Check the page bookkeeping and progress; the engine calls this when a plan is empty.

        Inconsistent pages (see `PageManager.audit`; logged loudly) fail the running requests, whose
        page tables can no longer be trusted, drop the cache and start the pool over all free;
        waiting requests stay queued and are computed afresh. A queue with nothing running
        that still admits nothing breaks the progress guarantee: its head request fails.
        Returns the requests that failed (FAILED set; their releases go with the next plan).
        """
        problems = self.pages.audit(self.running)
        if problems:
            log.error("BUG: KV page bookkeeping is inconsistent (%s); failing %d running "
                      "request(s) and dropping the prefix cache", "; ".join(problems),
                      len(self.running))
            failed = list(self.running)
            for request in failed:
                request.finish_reason = FinishReason.FAILED
                if request.on_workers:
                    self._releases.append(request.request_id)
            self.running.clear()
            self.pages.drop_all()
            return failed
        if self.waiting and not self.running:
            head = in_policy_order(self.waiting, self.policy, self.cache)[0]
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
            request.num_in_flight = 0
            self.end(request)
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
