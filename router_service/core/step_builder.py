"""The step builder: which tokens of which requests run in the next step.

`StepBuilder(lifecycle, limits, speculator).build()` fills one `StepPlan` within
`max_batch_tokens`, in this order:
1. running requests that decode (one pending token), in admission order (when there are more
   than the budget, the oldest go first; the others wait for them to end). A decode that needs a
   page it cannot get even after eviction retracts the most recently admitted request (the one
   that loses the least work) back to the queue;
2. running requests in the middle of a chunked prefill, as far as budget and pages allow;
3. waiting requests in admission order (see `admission`), while running slots, budget and pages
   last. A prefill longer than the remaining budget is cut into chunks computed over several
   steps. If deferral left the step empty, it admits again without deferring: the prefill it
   waits on may be stuck for pages.
If the plan is still empty while requests run, every one of them is stuck in a prefill with no
page to grow into: the newest is retracted so that the others can go on next step.

A decoding request may carry draft tokens (speculative decoding, see `speculation`) when the step
decodes few requests: they are proposed once its page for the next token is secured, get page
slots only from free or evictable pages (drafts never retract anyone) and use the budget left
once every decoding request has its one token.

The builder moves requests only through the `Lifecycle` it is given (`start` to admit,
`retract`, `end`), never by changing the waiting or running lists itself.

Invariants: a request is in a plan at most once; only requests not (yet) in the plan are
retracted while building it; every entry is made by `_add`, which advances the request's
`num_computed` and `num_pages_sent` as if the step had already run (the workers apply tasks in
order; a task every rank rejects fails its requests, see `Scheduler.fail_step`), and counts its
positions in flight and its token to be sampled until the step's result is applied (overlap
scheduling, see `lookahead`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from router_service.core.admission import Policy, defers, in_policy_order
from router_service.core.lifecycle import Lifecycle
from router_service.core.request import FinishReason, Pooling, Request
from router_service.core.speculation import Speculator
from router_service.core.step_plan import ScheduledEntry, StepPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepLimits:
    """What bounds a step and ends a request: the scheduler's settings, fixed per connection."""

    max_batch_tokens: int
    max_running_requests: int
    policy: Policy
    context_len: int
    eos_token_ids: frozenset[int]


class StepBuilder:
    """Builds one plan over the lifecycle's requests; the scheduler makes one per step.

    `speculator` None: no drafts.
    """

    def __init__(self, lifecycle: Lifecycle, limits: StepLimits, speculator: Speculator | None) -> None:
        self.lifecycle = lifecycle
        self.limits = limits
        self.speculator = speculator
        self.pages = lifecycle.pages
        self.plan = StepPlan()
        self.budget = limits.max_batch_tokens
        self.speculate = False  # whether this step proposes drafts (set with the decodes)

    def build(self) -> StepPlan:
        running = self.lifecycle.running
        # One pass sorts the running requests (their state before this plan): those that
        # decode (one pending token), those in the middle of a prefill, and those whose prefill
        # runs in this step or later, or in the step in flight (overlap): their pages are not
        # cached yet.
        decoding: list[Request] = []
        chunked: list[Request] = []
        prefilling: list[Request] = []
        for request in running:
            num_pending = request.num_pending
            if num_pending == 1:
                decoding.append(request)
            elif num_pending > 1:
                chunked.append(request)
            if num_pending > 1 or request.num_in_flight > 1:
                prefilling.append(request)
        self._add_decodes(decoding)
        self._add_prefill_chunks(chunked)
        if self._admit_waiting(prefilling) and not self.plan.entries:
            self._admit_waiting(None)
        if not self.plan.entries and any(self._has_work(request) for request in running):
            self.lifecycle.retract(running[-1])
        return self.plan

    def _add_decodes(self, decoding: list[Request]) -> None:
        """`decoding`: the running requests with one pending token, in admission order."""
        speculator = self.speculator
        self.speculate = speculate = speculator is not None and speculator.wants_drafts(len(decoding))
        spare = self.budget - len(decoding)  # budget left once every decode has its token
        context_len = self.limits.context_len
        page_size = self.pages.page_size
        for request in decoding:
            if self.budget == 0:
                break
            # Skip requests retracted just now (while planning the ones before them), and those
            # whose token in flight (overlap) is certainly their last: nothing more to compute.
            # Most decodes have room for their next token in their last page already.
            if (
                request.admitted_at >= 0
                and not (request.num_unresolved and request.ends_when_resolved(context_len))
                and (request.num_computed < len(request.page_table) * page_size
                     or self._grow_for_decode(request))
            ):
                # A request whose token is still in flight (overlap) has no known suffix to look up.
                drafting = speculate and not request.num_unresolved
                drafts = self._drafts_for(request, spare) if drafting else []
                self._add(request, 1, new_request=False, drafts=drafts)
                spare -= len(drafts)

    def _drafts_for(self, request: Request, limit: int) -> list[int]:
        """Drafts for a decoding request whose next page is secured, with pages for them.

        Draft positions get pages only when free or evictable ones exist: a draft is worth less
        than any request's progress, so it never retracts one; without pages it is cut short.
        Nothing follows a stop token among them (not even for `ignore_eos`).
        """
        assert self.speculator is not None  # drafts are asked for only when it wants them
        drafts = self.speculator.drafts(
            request.draft, request.token_ids, request.max_tokens - request.num_output, limit
        )
        for index, token in enumerate(drafts):
            if token in request.stop_token_ids or token in self.limits.eos_token_ids:
                drafts = drafts[: index + 1]
                break
        if drafts and not self.pages.grow(request, 1 + len(drafts)):
            drafts = drafts[: max(0, self.pages.room(request) - 1)]
            if drafts:
                self.pages.grow(request, 1 + len(drafts))  # fits: within `room`
        return drafts

    def _add_prefill_chunks(self, chunked: list[Request]) -> None:
        """`chunked`: the running requests with more than one pending token, in admission order."""
        for request in chunked:
            if self.budget == 0:
                break
            if request.admitted_at < 0:
                continue  # retracted while the decodes were planned
            num_tokens = min(request.num_pending, self.budget, self.pages.room(request))
            if num_tokens > 0:
                self.pages.grow(request, num_tokens)  # fits: within `room`
                self._add(request, num_tokens, new_request=False)

    def _grow_for_decode(self, request: Request) -> bool:
        """Give `request` a page for its next token, retracting others if need be.

        False when `request` itself was retracted (or ended because it cannot fit alone).
        """
        running = self.lifecycle.running
        while not self.pages.grow(request, 1):
            victim = running[-1]
            if victim is request and len(running) == 1:
                # `Scheduler.add` let in only requests that fit the pool alone: pages went missing.
                log.error("BUG: %s runs alone and finds no page for position %d; failing it",
                          request.request_id, request.num_computed)
                request.finish_reason = FinishReason.FAILED
                self.lifecycle.end(request)
                self.plan.ended.append(request)
                return False
            self.lifecycle.retract(victim)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, prefilling: list[Request] | None) -> bool:
        """Admit waiting requests within the budget; True when one was deferred.

        `prefilling` (None: defer nothing) are the running requests whose prefill is not cached
        yet; requests admitted here join it, since their pages are cached only after the step.
        """
        lifecycle = self.lifecycle
        deferred = False
        if self.budget == 0 or not lifecycle.waiting or not self._has_slot():
            return deferred
        for request in in_policy_order(lifecycle.waiting, self.limits.policy, self.pages.cache):
            if self.budget == 0 or not self._has_slot():
                break
            tokens = request.token_ids
            match = self.pages.cache.match_prefix(request.cacheable_prefix())
            may_defer = prefilling is not None and request.pooling is not Pooling.MEAN
            if may_defer and defers(request, match.matched_len, prefilling, self.pages.page_size):
                deferred = True
                continue  # not short of pages: the ones behind it may go
            num_tokens = min(len(tokens) - match.matched_len, self.budget)
            # Keep a page of headroom per running request, so that admitting does not make the
            # running ones retract at their next page boundary.
            if not self.pages.admit(request, match, num_tokens, num_spare_pages=len(lifecycle.running)):
                break  # keep the order: nothing behind it jumps ahead for pages
            lifecycle.start(request, match.matched_len)
            self._add(request, num_tokens, new_request=True)
            if prefilling is not None:
                prefilling.append(request)
        return deferred

    def _has_work(self, request: Request) -> bool:
        """Whether a running request has positions to compute now (not: only its last token in
        flight, which ends it)."""
        return request.num_pending > 0 and not request.ends_when_resolved(self.limits.context_len)

    def _has_slot(self) -> bool:
        return len(self.lifecycle.running) < self.limits.max_running_requests

    def _add(self, request: Request, num_tokens: int, *, new_request: bool, drafts: list[int] = ()) -> None:
        """Put `request`'s next `num_tokens` tokens, then `drafts`, in the plan (its pages
        already hold them)."""
        start = request.num_computed
        known_ids = request.token_ids
        num_known = len(known_ids)
        token_ids = known_ids[start : start + num_tokens]
        if drafts:
            token_ids += drafts
        sample = start + num_tokens == num_known + request.num_unresolved
        # Positional (the fields' order), once per request per step: keywords cost a tenth more.
        entry = ScheduledEntry(
            request,
            token_ids,
            start,  # start_position
            request.page_table[request.num_pages_sent :],  # new_page_ids
            sample,
            new_request,
            known_ids[:start] if new_request else [],  # cached_token_ids
            # A token sampled in the step in flight is referred to, not carried (`lookahead`).
            start == num_known,  # after_sampled
            request.admitted_at,
            len(drafts),  # num_draft_tokens
            # A request that samples now may draft next step, if drafts are on for this kind of
            # step and it is not pausing: that step must then wait for this one's tokens
            # (`lookahead`).
            sample and self.speculate and request.draft.cooldown == 0,  # may_draft_next
        )
        self.plan.add(entry)
        request.num_pages_sent = len(request.page_table)
        # Drafts count as computed while the step is in flight (a step with drafts never has a
        # step planned behind it); `Scheduler.complete` then counts only what was kept.
        request.num_computed = start + num_tokens + len(drafts)
        request.num_in_flight += num_tokens + len(drafts)
        request.num_unresolved += sample
        request.on_workers = True
        self.budget -= num_tokens + len(drafts)
