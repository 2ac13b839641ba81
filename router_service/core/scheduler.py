"""The continuous-batching scheduler: requests in, one step plan out, sampled tokens applied.

The `Scheduler` composes four parts:
- `PageManager` (`page_manager`): the KV page bookkeeping, allocator and radix cache;
- `Lifecycle` (`lifecycle`): the waiting and running requests and every move between them
  (queue, start, retract, end), with the ids the workers must forget;
- admission (`admission`): the waiting queue's policy order and deferral;
- `StepBuilder` (`step_builder`): which tokens of which requests run in the next step; it is
  given the lifecycle to admit, retract and end requests while it plans.
`add` queues a request once it is known to fit the pool alone; `schedule()` plans a step;
`complete(plan, token_ids, num_accepted)` applies the sampled tokens (after the drafts rank 0
accepted, see `speculation`), ends finished requests and caches every page the step wrote whole.

Plain Python over ints and lists, like everything it uses: no grpc, no torch.
"""

from __future__ import annotations

import logging

from router_service.core.admission import Policy, in_policy_order
from router_service.core.lifecycle import Lifecycle
from router_service.core.page_allocator import PageAllocator
from router_service.core.page_manager import PageManager
from router_service.core.radix_cache import RadixCache
from router_service.core.request import FinishReason, Request
from router_service.core.speculation import SpeculationConfig, Speculator
from router_service.core.stats import SchedulerStats
from router_service.core.step_builder import StepBuilder, StepLimits
from router_service.core.step_plan import ScheduledEntry, StepPlan
from router_service.errors import InvalidRequest

log = logging.getLogger(__name__)


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
        self.limits = StepLimits(max_batch_tokens, max_running_requests, policy, context_len, eos_token_ids)
        self.pages = PageManager(num_pages, page_size)
        self.stats = SchedulerStats()
        self.lifecycle = Lifecycle(self.pages, self.stats)
        self.speculator = Speculator(speculation, context_len) if speculation else None

    @property
    def waiting(self) -> list[Request]:
        return self.lifecycle.waiting

    @property
    def running(self) -> list[Request]:
        """The running requests, in admission order."""
        return self.lifecycle.running

    @property
    def max_batch_tokens(self) -> int:
        return self.limits.max_batch_tokens

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
        if request.num_prompt >= self.limits.context_len:
            raise InvalidRequest(
                f"prompt of {request.num_prompt} tokens leaves no room in the context of "
                f"{self.limits.context_len}"
            )
        final_len = min(request.num_prompt + request.max_tokens, self.limits.context_len)
        need = self.pages.pages_for(final_len - 1)
        if need > self.pages.num_pages:
            raise InvalidRequest(
                f"prompt of {request.num_prompt} tokens plus max_tokens {request.max_tokens} "
                f"needs {need} KV pages of {self.page_size} tokens; the pool holds "
                f"{self.pages.num_pages} pages"
            )
        self.lifecycle.queue(request)

    def cancel(self, request: Request) -> bool:
        """End a waiting or running request now; False when it had already ended."""
        return self.lifecycle.cancel(request)

    def schedule(self) -> StepPlan:
        """Plan the next step; it carries the releases collected since the last plan."""
        plan = StepBuilder(self.lifecycle, self.limits, self.speculator).build()
        plan.release_request_ids = self.lifecycle.take_releases()
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
        sampling = plan.sampling
        if len(sampling) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens for {len(sampling)} sampling entries")
        if num_accepted is None:
            num_accepted = [0] * len(sampling)
        self.stats.num_steps += 1
        fresh = [entry for entry in plan.entries if not entry.is_stale]
        for entry in fresh:
            entry.request.num_in_flight -= entry.num_tokens
        eos_token_ids, context_len = self.limits.eos_token_ids, self.limits.context_len
        updated: list[Request] = []
        for entry, token_id, accepted in zip(sampling, token_ids, num_accepted):
            if entry.is_stale:
                continue
            request = entry.request
            request.num_unresolved -= 1
            if entry.num_draft_tokens:
                self._append_verified(entry, token_id, accepted)
            else:
                request.append_token(token_id, eos_token_ids, context_len)
            updated.append(request)
            if request.finish_reason is not None:
                self.lifecycle.end(request)
        size = self.page_size
        for entry in fresh:
            request = entry.request
            if request.finish_reason is not None:
                continue  # ended just now: its pages are given back
            # Only when this step filled a page: most decode steps cost one comparison here.
            start = entry.start_position
            if entry.num_draft_tokens:
                end = request.num_computed  # the kept positions only
            else:
                end = start + len(entry.token_ids) + entry.after_sampled  # + `num_tokens`
            if end // size > start // size:
                self.pages.cache_written(request)
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
            request.append_token(token, self.limits.eos_token_ids, self.limits.context_len)
            num_appended += 1
            if request.finish_reason is not None:
                break
        num_used = min(num_appended, num_accepted)  # accepted drafts that became output
        # The last appended token is pending (its K/V is not kept), as after any decode step.
        request.num_computed = len(request.token_ids) - 1
        assert self.speculator is not None  # only a speculator proposes drafts
        self.speculator.record(request.draft, num_drafts, num_used)
        self.stats.num_draft_entries += 1
        self.stats.num_draft_tokens += num_drafts
        self.stats.num_accepted_draft_tokens += num_used

    def observe_step(self, plan: StepPlan, seconds: float) -> None:
        """The wall time of a step whose result came back: a step whose only entry decodes one
        request (its pending token and any drafts) teaches the speculator what drafts cost."""
        if self.speculator is None or len(plan.entries) != 1:
            return
        entry = plan.entries[0]
        drafts = entry.num_draft_tokens
        if not entry.new_request and entry.sample and entry.num_tokens == 1 + drafts:
            self.speculator.cost.observe(drafts, seconds)

    # ---- failures ------------------------------------------------------------------------

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
            failed = self.lifecycle.fail_running_without_pages()
            self.pages.drop_all()
            return failed
        if self.waiting and not self.running:
            head = in_policy_order(self.waiting, self.limits.policy, self.cache)[0]
            log.error("BUG: nothing runs and %s (%d tokens) is not admitted; failing it",
                      head.request_id, len(head.token_ids))
            self.lifecycle.fail_waiting(head)
            return [head]
        return []

    def fail_step(self, plan: StepPlan) -> list[Request]:
        """Every rank rejected `plan`'s task, applying none of it: fail the requests in it.

        Their pages past the cached ones may hold partial writes of that step: none of those
        enter the cache; cached pages were written by earlier steps and stay trusted. The
        task's releases go again with the next plan. Returns the failed requests.
        """
        self.lifecycle.restore_releases(plan.release_request_ids)
        failed = []
        for entry in plan.entries:
            request = entry.request
            if request.finish_reason is not None or request.admitted_at < 0:
                continue
            request.finish_reason = FinishReason.FAILED
            request.num_computed = request.num_tree_pages * self.page_size
            request.num_in_flight = 0
            self.lifecycle.end(request)
            failed.append(request)
        return failed

    def fail_all(self) -> list[Request]:
        """End every request (the workers failed): returns them, with FAILED set.

        Nothing goes into the cache: the workers' K/V can no longer be trusted.
        """
        return self.lifecycle.fail_all()
