"""Which replicas recently routed prompts went to, by their prefixes: so that a conversation's next
turn (which resends the whole history) goes where that history is cached, and a new session of a
spilled system prompt goes to a replica that already holds it.

Rendezvous order keys on a prompt's first tokens (the system prompt, shared by every session of
one agent), so it cannot tell two sessions apart; when bounded load spills a hot prefix, turns
of one session would land on whichever replica had room at the time, and each would recompute
the history. Here each routed prompt leaves the hashes of its prefixes at every whole multiple of
`stride` tokens, each mapped to the replicas that took it, most recent first (at most `holders`
of them: a hot system prompt spilled over several replicas is held by each). A later prompt
looks up its own prefixes at those multiples, longest first; the replicas of the longest one
found are its preferred replicas (still subject to a load bound, `bounded_load.choose_remembered`),
and whether that prefix was the whole-stride end of an earlier prompt tells a conversation's
next turn (its history is the earlier turn's prompt and answer) from a new session that only
shares a system prompt.

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
from typing import Generic, NamedTuple, TypeVar

Replica = TypeVar("Replica", bound=Hashable)

_BYTES_PER_TOKEN = 4


class Recalled(NamedTuple, Generic[Replica]):
    """What the memory knows of a prompt's longest remembered prefix."""

    holders: tuple[Replica, ...]  # the replicas that took it, most recent first (empty: none known)
    ended_a_prompt: bool  # it was the last whole stride of an earlier prompt (a conversation's history)


_NOTHING: Recalled = Recalled((), False)


class Held(NamedTuple, Generic[Replica]):
    """Every replica the memory names for some prefix of a prompt, with the longest such prefix."""

    replicas: tuple[tuple[Replica, int], ...]  # (replica, tokens of the prompt it holds): longest first,
    # most recent first among equals
    prefix_len: int  # tokens of the longest remembered prefix (0: none)
    ended_a_prompt: bool  # that prefix was the last whole stride of an earlier prompt


_NONE_HELD: Held = Held((), 0, False)


class PrefixMemory(Generic[Replica]):
    def __init__(self, num_entries: int, stride: int, holders: int = 1) -> None:
        if num_entries < 1 or stride < 1 or holders < 1:
            raise ValueError("a prefix memory needs at least one entry, one holder and a stride of one token")
        self.num_entries = num_entries
        self.stride = stride
        self.holders = holders
        # (holders, ended a prompt) per checkpoint: plain tuples, a `Recalled` only when asked.
        self._entries: OrderedDict[bytes, tuple[tuple[Replica, ...], bool]] = OrderedDict()

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

    def recall_all(self, checkpoints: Sequence[bytes]) -> Recalled[Replica]:
        """The replicas that took the longest of these prefixes lately (none: empty holders)."""
        for checkpoint in reversed(checkpoints):
            known = self._entries.get(checkpoint)
            if known is not None:
                self._entries.move_to_end(checkpoint)
                return Recalled(*known)
        return _NOTHING

    def recall_held(self, checkpoints: Sequence[bytes]) -> Held[Replica]:
        """Every replica that took one of these prefixes lately, with the longest it took (one
        lookup per checkpoint: a conversation's replica holds its history, the replicas of its
        system prompt only a shorter prefix)."""
        entries = self._entries
        found: dict[Replica, int] = {}
        longest = None
        for index in range(len(checkpoints) - 1, -1, -1):
            known = entries.get(checkpoints[index])
            if known is None:
                continue
            if longest is None:
                entries.move_to_end(checkpoints[index])
                longest = (index + 1) * self.stride, known[1]
            for replica in known[0]:
                found.setdefault(replica, (index + 1) * self.stride)
        if longest is None:
            return _NONE_HELD
        return Held(tuple(found.items()), *longest)

    def recall(self, checkpoints: Sequence[bytes]) -> Replica | None:
        """The replica that took the longest of these prefixes last, None if none did."""
        holders = self.recall_all(checkpoints).holders
        return holders[0] if holders else None

    def remember(self, checkpoints: Sequence[bytes], replica: Replica) -> None:
        """The prompt with these checkpoints went to `replica`."""
        entries = self._entries
        last = len(checkpoints) - 1
        for index, checkpoint in enumerate(checkpoints):
            known = entries.get(checkpoint)
            if known is None:
                entries[checkpoint] = ((replica,), index == last)
                continue
            entries.move_to_end(checkpoint)
            holders, ended = known
            if holders[0] != replica:
                holders = (replica, *[r for r in holders if r != replica][: self.holders - 1])
            elif ended or index != last:
                continue  # unchanged: the same replica again
            entries[checkpoint] = (holders, ended or index == last)
        while len(entries) > self.num_entries:
            entries.popitem(last=False)

    def forget(self, replica: Replica) -> None:
        """A replica left: it holds nothing any more (prefixes it alone held fall back to the
        rendezvous order)."""
        for checkpoint, (holders, ended) in list(self._entries.items()):
            if replica in holders:
                holders = tuple(r for r in holders if r != replica)
                if holders:
                    self._entries[checkpoint] = (holders, ended)
                else:
                    del self._entries[checkpoint]
