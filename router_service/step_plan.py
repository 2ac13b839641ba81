"""What one step runs: the scheduler's plain values for a step, free of grpc. `convert.task_to_proto`
is the one place they become the wire's `DecodeTask` and `TaskEntry`."""

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
    # Requests that ended while planning, with `finish_reason` FAILED: the scheduler found
    # its own bookkeeping broken (a request running alone found no page for its next token).
    ended: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.entries and not self.release_request_ids and not self.ended
