"""Rendezvous (highest random weight) order of router replicas for a prompt's prefix.

Requests whose prompts share their first `affinity_tokens` token ids get the same order, so each
replica's prefix cache stays warm without any shared state between gateways; the order is also
the failover order: when the first choice is down, its requests spread over the others the same
way on every gateway, and adding or removing one replica only moves the prompts that ranked it
first.

A replica's weight for a key is a 64-bit mix of the key's hash and the replica's own hash
(computed once per replica, `Ranking`): one hash per request and one multiply-and-shift mix per
replica (over all replicas at once, in numpy's uint64 arithmetic, which wraps as the mix wants),
so choosing the first replica costs a pass over the replicas and nothing more; the full order is
sorted only when a caller needs more than the first.

A leaf module: plain functions over names and token ids, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_MASK64 = (1 << 64) - 1
_MIX = (np.uint64(30), np.uint64(0xBF58476D1CE4E5B9), np.uint64(27), np.uint64(0x94D049BB133111EB), np.uint64(31))


def affinity_key(prompt_token_ids: Sequence[int], affinity_tokens: int) -> bytes:
    head = prompt_token_ids[:affinity_tokens]
    return b",".join(str(t).encode() for t in head)


def hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def weight(replica_hash: int, key_hash: int) -> int:
    """The replica's weight for the key: SplitMix64's finalizer over their xor (a bijection that
    spreads every input bit over the output, so weights of different replicas are independent
    and never equal). `Ranking.weights` computes the same for every replica at once."""
    x = replica_hash ^ key_hash
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Ranking:
    """Rendezvous weights over a fixed list of replica names (each hashed once)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self._hashes = np.array([hash64(name.encode()) for name in self.names], dtype=np.uint64)

    def weights(self, key: bytes) -> np.ndarray:
        """Each name's weight for `key` (uint64), in the order of `names`."""
        shift1, mul1, shift2, mul2, shift3 = _MIX
        x = self._hashes ^ np.uint64(hash64(key))
        x = (x ^ (x >> shift1)) * mul1
        x = (x ^ (x >> shift2)) * mul2
        return x ^ (x >> shift3)

    def order(self, key: bytes) -> list[str]:
        """Names from most to least preferred for `key`."""
        return [self.names[i] for i in ranked(self.weights(key))]


def ranked(weights: np.ndarray) -> list[int]:
    """Indices of `weights` from the highest weight to the lowest."""
    return np.argsort(weights)[::-1].tolist()


def rendezvous_order(addresses: Sequence[str], key: bytes) -> list[str]:
    """Addresses from most to least preferred for `key` (stable for a given set, whatever its
    order)."""
    return Ranking(sorted(addresses)).order(key)
