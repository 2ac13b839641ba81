"""Admission: which waiting request the step builder admits next.

The queue policy orders the waiting requests (`lpm`: longest cached prefix first, then arrival;
`fcfs`: arrival), and deferral holds back a request whose prompt a running prefill is about to
cache, so that a burst sharing an uncached prefix computes it once. Whether the pages and the
budget allow a request in is the step builder's and the page manager's business; admission only
says in which order to try, and whom to skip for now.
"""

from __future__ import annotations

import enum

from router_service.core.radix_cache import RadixCache
from router_service.core.request import Request

# Above this many waiting requests, `lpm` stops matching every one of them each step.
LPM_MAX_WAITING = 128


class Policy(enum.Enum):
    FCFS = "fcfs"
    LPM = "lpm"


def in_policy_order(waiting: list[Request], policy: Policy, cache: RadixCache) -> list[Request]:
    """`waiting` in admission order: `lpm`, longest cached prefix first; `fcfs`, arrival."""
    if len(waiting) == 1:
        return list(waiting)
    if policy is Policy.LPM and len(waiting) <= LPM_MAX_WAITING:
        def key(request: Request) -> tuple[int, int]:
            matched = cache.match_prefix(request.cacheable_prefix()).matched_len
            return (-matched, request.arrival)
        return sorted(waiting, key=key)
    return sorted(waiting, key=lambda request: request.arrival)


def defers(request: Request, matched_len: int, prefilling: list[Request], page_size: int) -> bool:
    """Whether `request` should wait for a running prefill that shares more with it.

    True when some request in `prefilling` that is still running has the same first
    `matched_len + page_size` tokens: once that prefill's pages are written (and so cached),
    this request matches at least one page more. Deferral ends on its own: those requests
    leave `prefilling` when their prefill is done, and then the match has caught up.
    """
    tokens = request.token_ids
    end = matched_len + page_size
    if end > len(tokens) - 1:
        return False  # a longer match could not be used: the last token is computed anyway
    page = tokens[matched_len:end]
    for other in prefilling:
        if other is request or other.admitted_at < 0 or len(other.token_ids) < end:
            continue
        # The page after the match first: it tells most requests apart at once.
        if (
            other.token_ids[matched_len:end] == page
            and other.token_ids[:matched_len] == tokens[:matched_len]
        ):
            return True
    return False
