"""Prefix affinity with a bound on load: consistent hashing with bounded loads (Mirrokni, Thorup
and Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018).

Pure affinity (`rendezvous.Ranking`, first choice) keeps each prompt prefix on one
replica, so its cache stays warm, but a popular prefix sends all of its traffic there while
the others idle. Here a request goes to the first replica in its rendezvous order whose load,
with this request added, stays within `bound` times the mean: a hot prefix spills to its second
choice (the same one on every gateway, which then warms its own cache) instead of queueing.

The capacity of each replica is `bound * (total + 1) / n` for `total` outstanding requests over
`n` replicas, rounded down to whole requests (so the replica chosen holds at most `bound` times
the mean, never a request more), but never below `ceil((total + 1) / n)`, which the least
loaded replica is always within (it holds at most `floor(total / n)`): some replica can always
take the request. Requests that finish between decisions can leave a replica above the capacity
for a while: nothing is ever moved. `bound` >= 1; a large bound is pure affinity, 1 is even load.

`choose_ranked` is the gateway's form: the replicas a prompt prefix memory remembers for the
request's longest known prefix (`prefix_memory`) are tried first, most recent first, within a
bound of their own (larger: a cached prefix there is worth more than a request's share of load
elsewhere), then the rendezvous order, sorted only when the first choice is full.
`choose_remembered` is the whole decision, memory included, that the gateway makes and the
simulator replays (`bench/routing_policies.py`): a conversation's next turn (its longest known
prefix ended an earlier prompt: its history) gets `Bounds.session`, so it meets the replica
holding its history even after its system prompt spilled; a new session of a known system prompt
gets `Bounds.memory` over the replicas holding that prompt, so a spilled hot prefix stays on the
few replicas it warmed instead of warming more. With `Bounds.recompute_tokens` set, the memory's
replicas are weighed by work instead of taken in order (`choose_by_work`): what leaving a
replica that holds a prefix costs (the tokens to recompute elsewhere: a conversation's whole
history, or only the part of it past a system prompt that another replica holds) against the
load staying there adds (its outstanding requests above the rendezvous order's bound).

Plain functions over addresses and counts (and the rendezvous weights), no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from gateway_service.prefix_memory import Held, PrefixMemory
from gateway_service.rendezvous import ranked


Replica = TypeVar("Replica", bound=Hashable)  # an address, or an index in a simulation


def capacity(total_load: int, num_replicas: int, bound: float) -> int:
    """The most outstanding requests one replica may have after taking the next one."""
    if num_replicas < 1:
        raise ValueError("at least one replica is needed")
    if bound < 1:
        raise ValueError(f"the load bound must be >= 1, got {bound}")
    allowed = bound * (total_load + 1) / num_replicas
    if allowed >= total_load + 1:  # a bound past every load (inf too): pure affinity
        return total_load + 1
    return max(math.floor(allowed), -(-(total_load + 1) // num_replicas))


def choose_bounded(
    order: Sequence[Replica], loads: Mapping[Replica, int], bound: float,
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


def choose_ranked(
    replicas: Sequence[Replica], weights: np.ndarray, loads: Mapping[Replica, int],
    bound: float, total_load: int | None = None, preferred: Sequence[Replica] = (),
    preferred_bound: float | None = None,
) -> Replica:
    """As `choose_bounded` over `replicas` in the order of their rendezvous `weights`
    (`rendezvous.Ranking.weights`, highest first), with `preferred` (each one of `replicas`)
    tried first, in their order, within `preferred_bound` (never less than `bound`)."""
    if not replicas:
        raise ValueError("no replica to choose from")
    if total_load is None:
        total_load = sum(loads.get(replica, 0) for replica in replicas)
    if preferred:
        limit = capacity(total_load, len(replicas), max(bound, preferred_bound or bound))
        for replica in preferred:
            if loads.get(replica, 0) + 1 <= limit:
                return replica
    limit = capacity(total_load, len(replicas), bound)
    first = replicas[int(weights.argmax())]
    if loads.get(first, 0) + 1 <= limit:
        return first
    return choose_bounded([replicas[i] for i in ranked(weights)], loads, bound, total_load)


@dataclass(frozen=True, slots=True)
class Bounds:
    """The load bounds of one decision, each a multiple of the mean (`capacity`); the gateway's
    come from its flags (`GatewayConfig.bounds`)."""

    load: float  # the rendezvous order's
    memory: float  # replicas holding the request's longest known shared prefix (never below `load`)
    session: float  # the replica holding a conversation's history (never below `load`)
    # Prompt tokens whose recomputation on another replica costs as much as one more outstanding
    # request on a replica that holds them (`choose_by_work`); 0: the memory's replicas are
    # taken in their order while within their bound.
    recompute_tokens: int = 0


def choose_remembered(
    replicas: Sequence[Replica], weights: np.ndarray, loads: Mapping[Replica, int], bounds: Bounds,
    memory: PrefixMemory[Replica] | None, prompt_token_ids: Sequence[int], total_load: int | None = None,
) -> Replica:
    """The replica for a prompt (see the module's docstring), remembered in `memory` (None:
    `choose_ranked` over the rendezvous order alone). Holders the memory names that are not
    in `loads` (down, or gone) are skipped."""
    if memory is None:
        return choose_ranked(replicas, weights, loads, bounds.load, total_load)
    checkpoints = memory.checkpoints(prompt_token_ids)
    if bounds.recompute_tokens:
        chosen = choose_by_work(replicas, weights, loads, bounds, memory.recall_held(checkpoints), total_load)
        memory.remember(checkpoints, chosen)
        return chosen
    recalled = memory.recall_all(checkpoints)
    holders = [replica for replica in recalled.holders if replica in loads]
    chosen = choose_ranked(replicas, weights, loads, bounds.load, total_load, holders,
                           bounds.session if recalled.ended_a_prompt else bounds.memory)
    memory.remember(checkpoints, chosen)
    return chosen


def choose_by_work(
    replicas: Sequence[Replica], weights: np.ndarray, loads: Mapping[Replica, int], bounds: Bounds,
    held: Held[Replica], total_load: int | None = None,
) -> Replica:
    """The replica that costs the least work for a prompt whose prefixes `held` names: each
    replica the memory names, and the first in rendezvous order, costs the prompt tokens it does
    not hold (to recompute there) plus `bounds.recompute_tokens` per outstanding request it has,
    with this one, above `capacity` at `bounds.load`. So a request stays on the replica holding
    its longest prefix until that replica's excess load outweighs recomputing what it holds
    elsewhere: a long conversation's history holds it longer than a system prompt that other
    replicas hold too. The memory's replicas are taken only within their own bound
    (`bounds.session` for a conversation's history, `bounds.memory` for a shared prefix), the
    first in rendezvous order within `bounds.load`; ties go to the longer held prefix, then the
    more recent, then the rendezvous order. When none of them is within its bound:
    `choose_ranked` over the rendezvous order."""
    if not replicas:
        raise ValueError("no replica to choose from")
    if total_load is None:
        total_load = sum(loads.get(replica, 0) for replica in replicas)
    num_replicas = len(replicas)
    base = capacity(total_load, num_replicas, bounds.load)
    limit = capacity(total_load, num_replicas, bounds.session if held.ended_a_prompt else bounds.memory)
    first = replicas[int(weights.argmax())]
    best, best_cost = None, None
    for replica, held_len in (*held.replicas, (first, 0)):
        load = loads.get(replica)
        if load is None or load + 1 > (base if held_len == 0 else limit):
            continue  # down or gone, or over its bound
        cost = max(load + 1 - base, 0) * bounds.recompute_tokens + held.prefix_len - held_len
        if best_cost is None or cost < best_cost:
            best, best_cost = replica, cost
    if best is None:
        return choose_ranked(replicas, weights, loads, bounds.load, total_load)
    return best
