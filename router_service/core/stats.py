"""The scheduler's counters: a leaf value that the lifecycle, the scheduler, the engine and the
one conversion to GetStats' message (`convert.stats_to_proto`) all read."""

from __future__ import annotations

from dataclasses import astuple, dataclass


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
