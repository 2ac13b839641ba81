"""What one step runs: the scheduler's plain values for a step, free of grpc. `convert.task_to_proto`
is the one place they become the wire's `DecodeTask` and `TaskEntry`."""

from __future__ import annotations

from dataclasses import dataclass, field

from router_service.core.request import Request


@dataclass(slots=True)
class ScheduledEntry:
    """One request's work in a step. `cached_token_ids` is set only with `new_request`.

    `after_sampled`: the entry's first token is the one sampled for the request in the step
    before, still in flight (overlap scheduling); `token_ids` holds only the tokens after it.
    `admitted_at` is the request's admission when planned: an entry whose request has since
    ended, or been retracted (and maybe admitted again), is stale and its result is discarded.
    """

    request: Request
    token_ids: list[int]
    start_position: int
    new_page_ids: list[int]
    sample: bool
    new_request: bool
    cached_token_ids: list[int]
    after_sampled: bool = False
    admitted_at: int = -1
    # Speculative decoding: the last `num_draft_tokens` of `token_ids` are drafts to verify.
    num_draft_tokens: int = 0
    # The request may draft in its next step, which needs this step's tokens to look them up.
    may_draft_next: bool = False

    @property
    def num_tokens(self) -> int:
        """Positions this entry computes."""
        return len(self.token_ids) + self.after_sampled

    @property
    def is_stale(self) -> bool:
        request = self.request
        return request.finish_reason is not None or request.admitted_at != self.admitted_at

    @property
    def next_position_known(self) -> bool:
        """Where the request goes on after this entry is known before its result: the entry
        computes its tokens and samples at most one, which the next step computes at the
        following position. An entry that verifies draft tokens says False: how many are
        accepted decides the next positions and pages. So does one whose request may draft next
        step: drafts are looked up after the tokens this step samples, so speculation, when a
        request is drafting, goes before overlap."""
        return self.num_draft_tokens == 0 and not self.may_draft_next


@dataclass(slots=True)
class StepPlan:
    entries: list[ScheduledEntry] = field(default_factory=list)
    # Requests the workers should forget (ended or retracted since the last step).
    release_request_ids: list[str] = field(default_factory=list)
    # Requests that ended while planning, with `finish_reason` FAILED: the scheduler found
    # its own bookkeeping broken (a request running alone found no page for its next token).
    ended: list[Request] = field(default_factory=list)
    # Positions the entries compute, in all (the sum of their `num_tokens`, kept as they are added).
    num_tokens: int = 0
    # The entries that sample a token, in entry order: the step's result has one token for each.
    sampling: list[ScheduledEntry] = field(default_factory=list)
    # Whether the next step may be planned and sent before this one's result is back (overlap
    # scheduling): only when every entry's `next_position_known`. Kept as entries are added.
    allows_lookahead: bool = True

    def add(self, entry: ScheduledEntry) -> None:
        self.entries.append(entry)
        self.num_tokens += entry.num_tokens
        if entry.sample:
            self.sampling.append(entry)
        if not entry.next_position_known:
            self.allows_lookahead = False

    @property
    def is_empty(self) -> bool:
        return not self.entries and not self.release_request_ids and not self.ended

    @property
    def sends_task(self) -> bool:
        return bool(self.entries or self.release_request_ids)

