"""Which replica each recently routed prompt went to, by its prefix: so that a conversation's next
turn (which resends the whole history) goes where that history is cached.

Rendezvous order keys on a prompt's first tokens (the system prompt, shared by every session of
one agent), so it cannot tell two sessions apart; when bounded load spills a hot prefix, turns
of one session would land on whichever replica had room at the time, and each would recompute
the history. Here each routed prompt leaves the hashes of its prefixes at every whole multiple of
`stride` tokens, each mapped to the replica chosen (the longer ones tell sessions apart, the
shorter ones send a new session of a spilled system prompt where that prompt was last cached). A
later prompt looks up its own prefixes at those multiples, longest first; the replica of the
longest one found is its preferred replica (still subject to the load bound,
`bounded_load.choose_ranked`).

Soft state, bounded by `num_entries` (least recently used out first) and local to one gateway:
a turn that reaches another gateway falls back to the rendezvous order, which is the same on
every gateway. The cost per request is one hash over the prompt's tokens and one lookup per
`stride` tokens: nothing depends on the number of replicas.

A leaf module: no I/O.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

Replica = TypeVar("Replica", bound=Hashable)

_BYTES_PER_TOKEN = 4


class PrefixMemory(Generic[Replica]):
    def __init__(self, num_entries: int, stride: int) -> None:
        if num_entries < 1 or stride < 1:
            raise ValueError("a prefix memory needs at least one entry and a stride of one token")
        self.num_entries = num_entries
        self.stride = stride
        self._entries: OrderedDict[bytes, Replica] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def checkpoints(self, prompt_token_ids: Sequence[int]) -> list[bytes]:
        """Hashes of the prompt's prefixes of `stride`, 2 `stride`, ... tokens, shortest first."""
        data = array.array("I", prompt_token_ids).tobytes()
        step = self.stride * _BYTES_PER_TOKEN
        digest = hashlib.blake2b(digest_size=16)
        hashes = []
        for end in range(step, len(data) + 1, step):
            digest.update(data[end - step : end])
            hashes.append(digest.digest())
        return hashes

    def recall(self, checkpoints: Sequence[bytes]) -> Replica | None:
        """The replica that took the longest of these prefixes lately, None if none did."""
        for checkpoint in reversed(checkpoints):
            replica = self._entries.get(checkpoint)
            if replica is not None:
                self._entries.move_to_end(checkpoint)
                return replica
        return None

    def remember(self, checkpoints: Sequence[bytes], replica: Replica) -> None:
        """The prompt with these checkpoints went to `replica`."""
        entries = self._entries
        for checkpoint in checkpoints:
            entries[checkpoint] = replica
            entries.move_to_end(checkpoint)
        while len(entries) > self.num_entries:
            entries.popitem(last=False)

    def forget(self, replica: Replica) -> None:
        """A replica left: its entries go (their prompts fall back to the rendezvous order)."""
        for checkpoint in [c for c, r in self._entries.items() if r == replica]:
            del self._entries[checkpoint]
