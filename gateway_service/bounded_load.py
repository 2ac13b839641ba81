"""Prefix affinity with a bound on load: consistent hashing with bounded loads (Mirrokni, Thorup
and Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018).

Pure affinity (`router_choice.rendezvous_order`, first choice) keeps each prompt prefix on one
replica, so its cache stays warm, but a popular prefix sends all of its traffic there while
the others idle. Here a request goes to the first replica in its rendezvous order whose load,
with this request added, stays within `bound` times the mean: a hot prefix spills to its second
choice (the same one on every gateway, which then warms its own cache) instead of queueing.

The capacity of each replica is `ceil(bound * (total + 1) / n)` for `total` outstanding
requests over `n` replicas, so at least one replica is always under it (their loads cannot all
reach it), and the replica chosen holds at most `bound` times the mean, rounded up to a whole
request. Requests that finish between decisions can leave a replica above the capacity for a
while: nothing is ever moved. `bound` >= 1; a large bound is pure affinity, 1 is even load.

A leaf module: plain functions over addresses and counts, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

DEFAULT_BOUND = 1.25

Replica = TypeVar("Replica", bound=Hashable)  # an address, or an index in a simulation


def capacity(total_load: int, num_replicas: int, bound: float) -> int:
    """The most outstanding requests one replica may have after taking the next one."""
    if num_replicas < 1:
        raise ValueError("at least one replica is needed")
    if bound < 1:
        raise ValueError(f"the load bound must be >= 1, got {bound}")
    return math.ceil(bound * (total_load + 1) / num_replicas)


def choose_bounded(
    order: Sequence[Replica], loads: Mapping[Replica, int], bound: float = DEFAULT_BOUND,
    total_load: int | None = None,
) -> Replica:
    """The first of `order` (a rendezvous order, most preferred first) whose load plus this
    request is within the capacity; `loads` gives each replica's outstanding requests (a
    replica missing from it has none). `total_load`: their sum over `order`, when the caller
    keeps it (None: summed here, one addition per replica)."""
    if not order:
        raise ValueError("no replica to choose from")
    if total_load is None:
        total_load = sum(loads.get(address, 0) for address in order)
    limit = capacity(total_load, len(order), bound)
    for address in order:
        if loads.get(address, 0) + 1 <= limit:
            return address
    raise AssertionError("unreachable: some replica is always under the capacity")
