"""The routing policies the simulator compares (bench/simulate_routing.py).

Each policy picks a replica index for a prompt from every replica's load (outstanding requests:
running plus waiting), as a gateway would from the figures routers report:
- round robin;
- least loaded (ties: the lowest index);
- prefix affinity: the first replica in the rendezvous order of the prompt's first 64 tokens,
  exactly as the gateway routes today (`gateway_service.router_choice`);
- bounded-load affinity, as the gateway routes (`gateway_service.bounded_load.choose_remembered`,
  the same code): among the replicas its prefix memory names for some prefix of the prompt,
  within their bound of the mean load (the gateway's defaults: 1.4, for a conversation's history
  and for a shared prefix alike), and the first in rendezvous order within its bound (1.1), the
  one whose excess load and prompt tokens to recompute cost the least work (`--recompute-tokens`);
  else the next in rendezvous order within the bound; and the same without the prefix memory;
- cache aware: SGLang's `cache_aware` policy as its documentation describes it, written here
  from that description (`CacheAware`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from gateway_service.bounded_load import Bounds, choose_remembered
from gateway_service.config import GatewayConfig
from gateway_service.prefix_memory import PrefixMemory
from gateway_service.rendezvous import Ranking, affinity_key

_GATEWAY = GatewayConfig()  # the gateway's defaults
AFFINITY_TOKENS = _GATEWAY.affinity_tokens


class Loads(dict[int, int]):
    """Outstanding requests per replica index, and their sum (kept as they change)."""

    def __init__(self, num_replicas: int) -> None:
        super().__init__(dict.fromkeys(range(num_replicas), 0))
        self.total = 0

    def add(self, index: int, delta: int) -> None:
        self[index] += delta
        self.total += delta


class RoundRobin:
    name = "round robin"

    def __init__(self, num_replicas: int) -> None:
        self._next = itertools.cycle(range(num_replicas))

    def choose(self, prompt_ids: Sequence[int], loads: Loads) -> int:
        return next(self._next)


class LeastLoaded:
    name = "least loaded"

    def __init__(self, num_replicas: int) -> None:
        pass

    def choose(self, prompt_ids: Sequence[int], loads: Loads) -> int:
        return min(loads, key=loads.__getitem__)


class PrefixAffinity:
    """The rendezvous order of a prompt's affinity key, over names like the gateway's
    addresses (`gateway_service.rendezvous`). `memo` keeps each key's weights (the simulation's
    shortcut: the same weights every time); the timing of a decision runs without it."""

    name = "prefix affinity"

    def __init__(self, num_replicas: int, memo: bool = True) -> None:
        self._ranking = Ranking([f"10.0.{i // 256}.{i % 256}:50052" for i in range(num_replicas)])
        self._indices = range(num_replicas)
        self._memo: dict[bytes, np.ndarray] | None = {} if memo else None

    def weights(self, prompt_ids: Sequence[int]) -> np.ndarray:
        key = affinity_key(prompt_ids, AFFINITY_TOKENS)
        if self._memo is not None and key in self._memo:
            return self._memo[key]
        weights = self._ranking.weights(key)
        if self._memo is not None:
            self._memo[key] = weights
        return weights

    def choose(self, prompt_ids: Sequence[int], loads: Loads) -> int:
        return int(self.weights(prompt_ids).argmax())


class BoundedLoad(PrefixAffinity):
    """The gateway's choice (`gateway_service.router_choice.RouterPool.order`): bounded load over
    the rendezvous order, the prefix memory's replicas first (`prefix_memory=False`: without),
    with `gateway`'s settings (default: the gateway's defaults). `bound` replaces its load bound,
    `memory_bound` (None: its own) its memory and session bounds."""

    name = "bounded load"

    def __init__(
        self, num_replicas: int, memo: bool = True, bound: float | None = None, prefix_memory: bool = True,
        memory_bound: float | None = None, gateway: GatewayConfig = _GATEWAY,
    ) -> None:
        super().__init__(num_replicas, memo)
        bounds = gateway.bounds
        if bound is not None:
            bounds = Bounds(bound, max(bound, bounds.memory), max(bound, bounds.session), bounds.recompute_tokens)
        if memory_bound is not None:
            bounds = Bounds(bounds.load, max(bounds.load, memory_bound), max(bounds.load, memory_bound),
                            bounds.recompute_tokens)
        self.bounds = bounds
        self.bound = bounds.load
        self._memory: PrefixMemory[int] | None = (
            PrefixMemory(gateway.prefix_memory_entries, gateway.prefix_memory_stride, gateway.prefix_memory_holders)
            if prefix_memory else None)
        if not prefix_memory:
            self.name = "bounded, no memory"

    def choose(self, prompt_ids: Sequence[int], loads: Loads) -> int:
        return choose_remembered(self._indices, self.weights(prompt_ids), loads, self.bounds, self._memory,
                                 prompt_ids, loads.total)


class BoundedLoadNoMemory(BoundedLoad):
    name = "bounded, no memory"

    def __init__(
        self, num_replicas: int, memo: bool = True, bound: float | None = None, gateway: GatewayConfig = _GATEWAY,
    ) -> None:
        super().__init__(num_replicas, memo, bound, prefix_memory=False, gateway=gateway)


class _Node:
    __slots__ = ("children", "tenants")

    def __init__(self) -> None:
        self.children: dict[tuple[int, ...], _Node] = {}
        self.tenants: set[int] = set()


class CacheAware:
    """SGLang's `cache_aware` routing, from its documentation's description.

    The router keeps an approximate prefix tree of what it sent to each worker (one tree whose
    nodes record which workers hold them). When the load is imbalanced (busiest minus idlest
    above `balance_abs_threshold` and busiest above `balance_rel_threshold` times the idlest) a
    request goes to the least loaded worker. Otherwise it goes to the worker whose tree matches
    the longest prefix of it when that match covers more than `cache_threshold` of the prompt,
    else to the worker with the smallest tree (the most room for new prefixes). Either way the
    request's tokens enter the chosen worker's tree.
    Our choices where the description leaves them open: the tree holds whole chunks of
    `CHUNK` tokens (the KV page size); ties between workers go to the less loaded; the tree is
    never pruned (the documented pruning runs every two minutes towards a size far above what
    a simulated run inserts).
    """

    name = "cache aware"
    CHUNK = 16

    def __init__(
        self, num_replicas: int, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._root = _Node()
        self._tree_size = [0] * num_replicas  # chunks per worker

    def choose(self, prompt_ids: Sequence[int], loads: Loads) -> int:
        busiest, idlest = max(loads.values()), min(loads.values())
        imbalanced = (busiest - idlest > self.balance_abs_threshold
                      and busiest > self.balance_rel_threshold * idlest)
        chunks = self._chunks(prompt_ids)
        if imbalanced:
            chosen = min(loads, key=loads.__getitem__)
        else:
            matched_len, holders = self._match(chunks)
            if holders and matched_len > self.cache_threshold * len(prompt_ids):
                chosen = min(holders, key=lambda worker: (loads[worker], worker))
            else:
                chosen = min(loads, key=lambda worker: (self._tree_size[worker], loads[worker], worker))
        self._insert(chunks, chosen)
        return chosen

    def _chunks(self, prompt_ids: Sequence[int]) -> list[tuple[int, ...]]:
        size = self.CHUNK
        return [tuple(prompt_ids[start : start + size]) for start in range(0, len(prompt_ids) - size + 1, size)]

    def _match(self, chunks: list[tuple[int, ...]]) -> tuple[int, set[int]]:
        """The longest whole-chunk match and the workers holding it (every node on a worker's
        path holds the worker, so the deepest node's holders are the best matches)."""
        node, depth, holders = self._root, 0, set()
        for chunk in chunks:
            child = node.children.get(chunk)
            if child is None or not child.tenants:
                break
            node, depth, holders = child, depth + 1, child.tenants
        return depth * self.CHUNK, holders

    def _insert(self, chunks: list[tuple[int, ...]], worker: int) -> None:
        node = self._root
        for chunk in chunks:
            child = node.children.get(chunk)
            if child is None:
                child = node.children[chunk] = _Node()
            if worker not in child.tenants:
                child.tenants.add(worker)
                self._tree_size[worker] += 1
            node = child


POLICIES = (RoundRobin, LeastLoaded, PrefixAffinity, BoundedLoadNoMemory, BoundedLoad, CacheAware)
