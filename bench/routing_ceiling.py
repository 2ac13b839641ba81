"""The best hit rate any routing policy could reach on a simulated run with its busiest replica
within a bound of the mean load (bench/simulate_routing.py prints it beside each policy).

What every policy must miss, as a relaxation (so the figure is a ceiling, not a policy):
- a prompt's tokens that no earlier prompt had (a new system prompt, every user message), and
  what the radix cache cannot serve of the rest (whole pages only, never the last token);
- the system prompt once more on every replica beyond the first that serves it. Load is
  each request's time outstanding (arrival to finish, within the window the simulator averages
  busiest/mean over), so a system prompt whose requests carry W of the fleet's total load T
  needs at least W / (bound x T / replicas) replicas to keep each of them within the bound:
  each of those computes it once.
Everything else is assumed served from the cache: no evictions, no request arriving before the
prefix it shares has been computed, every conversation kept on its replica, replicas hosting
several prompts without counting their sum against the bound. A policy can only do worse.

The loads are the run's own (queueing makes them depend on the policy a little), so each
policy's row has its own ceiling.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Served:
    """One request, as the ceiling sees it."""

    system_key: Hashable  # which system prompt it starts with
    system_len: int  # that prompt's length in tokens
    prompt_len: int
    shared_len: int  # tokens at its head that an earlier request's prompt had (0 for the first of a system prompt)
    load_s: float  # seconds outstanding within the averaging window


def cacheable(shared_len: int, prompt_len: int, page_size: int) -> int:
    """What the radix cache can serve of `shared_len` shared tokens: whole pages, not the last
    token (Request.cacheable_prefix)."""
    return min(shared_len, prompt_len - 1) // page_size * page_size


def hit_rate_ceiling(requests: Iterable[Served], num_replicas: int, bound: float, page_size: int) -> float:
    """The prompt tokens some policy could serve from the cache, over all prompt tokens, with
    no replica's load above `bound` times the mean (see the module's docstring)."""
    prompt_tokens = hit_tokens = 0
    total_load = 0.0
    loads: dict[Hashable, float] = {}
    counts: dict[Hashable, int] = {}
    lengths: dict[Hashable, int] = {}
    for request in requests:
        prompt_tokens += request.prompt_len
        hit_tokens += cacheable(request.shared_len, request.prompt_len, page_size)
        total_load += request.load_s
        loads[request.system_key] = loads.get(request.system_key, 0.0) + request.load_s
        counts[request.system_key] = counts.get(request.system_key, 0) + 1
        lengths[request.system_key] = request.system_len
    if not prompt_tokens:
        raise ValueError("no requests")
    capacity = bound * total_load / num_replicas  # the most load one replica may carry
    for key, load in loads.items():
        replicas = min(counts[key], max(1, math.ceil(load / capacity - 1e-9))) if capacity > 0 else 1
        # Each replica beyond the first computes the system prompt again (a request of a new
        # session there, or a moved conversation, which misses even more).
        hit_tokens -= (replicas - 1) * (lengths[key] // page_size * page_size)
    return hit_tokens / prompt_tokens
