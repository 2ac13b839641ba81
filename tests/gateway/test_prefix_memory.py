"""The gateway's prompt prefix memory: a conversation's next turn finds the replica of its history."""

from __future__ import annotations

import pytest

from gateway_service.prefix_memory import PrefixMemory


def test_the_longest_remembered_prefix_names_the_replica() -> None:
    memory: PrefixMemory[str] = PrefixMemory(100, stride=4)
    system = list(range(10, 18))  # two whole strides
    turn1 = system + [1, 2, 3, 4, 5]
    assert len(memory.checkpoints(turn1)) == 3  # 4, 8 and 12 tokens; the 13th is not a whole stride
    assert memory.recall(memory.checkpoints(turn1)) is None
    memory.remember(memory.checkpoints(turn1), "a")
    other_session = system + [9, 9, 9, 9, 9, 9]
    memory.remember(memory.checkpoints(other_session), "b")
    # The first session's next turn resends its history: its own 12-token prefix is the longest.
    turn2 = turn1 + [7] * 10
    assert memory.recall(memory.checkpoints(turn2)) == "a"
    # A new session of the same system prompt goes where that prompt went last.
    assert memory.recall(memory.checkpoints(system + [6, 6, 6, 6])) == "b"
    assert memory.recall(memory.checkpoints([1, 2, 3, 4, 5, 6, 7, 8])) is None
    assert memory.recall(memory.checkpoints([10, 11, 12])) is None  # shorter than one stride


def test_it_stays_within_its_entries_and_forgets_a_replica() -> None:
    memory: PrefixMemory[str] = PrefixMemory(5, stride=2)
    first = [1, 2, 3, 4]
    memory.remember(memory.checkpoints(first), "a")
    for i in range(3):
        memory.remember(memory.checkpoints([50 + i, 60 + i]), "b")
    assert len(memory) == 5
    memory.remember(memory.checkpoints([70, 80]), "c")  # the least recently used goes: [1, 2]
    assert len(memory) == 5
    assert memory.recall(memory.checkpoints([1, 2])) is None
    assert memory.recall(memory.checkpoints(first)) == "a"
    memory.forget("b")
    assert len(memory) == 2
    assert memory.recall(memory.checkpoints([50, 60])) is None
    with pytest.raises(ValueError):
        PrefixMemory(0, 4)
    with pytest.raises(ValueError):
        PrefixMemory(4, 4, holders=0)


def test_a_prefix_keeps_its_recent_holders_and_whether_it_ended_a_prompt() -> None:
    memory: PrefixMemory[str] = PrefixMemory(100, stride=4, holders=2)
    system = list(range(10, 18))
    for replica in ("a", "b", "c", "b"):
        memory.remember(memory.checkpoints(system + [replica.encode()[0]] * 6), replica)
    new_session = memory.recall_all(memory.checkpoints(system + [1, 1, 1, 1]))
    assert new_session.holders == ("b", "c")  # most recent first, at most two, no repeats
    assert not new_session.ended_a_prompt  # the system prompt never ended a prompt
    turn1 = system + [5] * 4  # 12 tokens: three whole strides, the last one ends the prompt
    memory.remember(memory.checkpoints(turn1), "a")
    next_turn = memory.recall_all(memory.checkpoints(turn1 + [6] * 9))
    assert next_turn.holders == ("a",) and next_turn.ended_a_prompt
    assert memory.recall_all(memory.checkpoints(system)).holders == ("a", "b")  # "c" dropped out
    memory.forget("b")
    assert memory.recall_all(memory.checkpoints(system + [1, 1, 1, 1])).holders == ("a",)
    memory.forget("a")  # the prefixes "a" alone held go
    assert memory.recall(memory.checkpoints(turn1)) is None
    assert memory.recall_all(memory.checkpoints(system + [3] * 4)) == ((), False)


def test_it_names_every_replica_holding_a_prefix_with_the_longest_it_holds() -> None:
    memory: PrefixMemory[str] = PrefixMemory(100, stride=4, holders=2)
    system = list(range(10, 18))  # two strides
    memory.remember(memory.checkpoints(system + [1] * 4), "a")
    turn1 = system + [2] * 8  # four strides
    memory.remember(memory.checkpoints(turn1), "b")
    held = memory.recall_held(memory.checkpoints(turn1 + [3] * 6))
    # "b" holds the whole history (16 tokens, the end of its prompt), "a" the system prompt.
    assert held == (( ("b", 16), ("a", 8) ), 16, True)
    held = memory.recall_held(memory.checkpoints(system + [1] * 4 + [5] * 4))
    assert held.replicas == (("a", 12), ("b", 8)) and held.prefix_len == 12 and held.ended_a_prompt
    assert memory.recall_held(memory.checkpoints([99] * 8)) == ((), 0, False)
