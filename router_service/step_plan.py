"""What one scheduler step runs, and the scheduler's counters: plain values the engine turns
into a `DecodeTask` (in `convert`) and into GetStats."""

from __future__ import annotations

from dataclasses import dataclass, field

from router_service.request import Request


@dataclass(slots=True)
class ScheduledEntry:
    """One request's work in a step. `cached_token_ids` is set only with `new_request`."""

    request: Request
    token_ids: list[int]
    start_position: int
    new_page_ids: list[int]
    sample: bool
    new_request: bool
    cached_token_ids: list[int]


@dataclass(slots=True)
class StepPlan:
    entries: list[ScheduledEntry] = field(default_factory=list)
    # Requests the workers should forget (ended or retracted since the last step).
    release_request_ids: list[str] = field(default_factory=list)
    # Requests that ended while planning, `finish_reason` set: FAILED when the scheduler found
    # its own bookkeeping broken (see `page_audit`).
    ended: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.entries and not self.release_request_ids and not self.ended


@dataclass(slots=True)
class SchedulerStats:
    num_steps: int = 0
    num_retractions: int = 0
    cache_hit_tokens: int = 0
    prompt_tokens: int = 0
    num_audit_failures: int = 0
