"""Entries that refer to the token the previous task sampled (overlap scheduling): resolved in
place from the last applied task, refused (before any collective) when they refer to anything
else. The broadcast to other ranks is exercised by the router's TP=2 overlap test."""

from __future__ import annotations

import pytest

from radixserve.v1 import worker_pb2
from worker_service.distributed import TPGroup
from worker_service.sampled_tokens import BadReference, SampledTokens


def applied(sampled: SampledTokens, task_id: int, tokens: dict[str, int]) -> None:
    task = worker_pb2.DecodeTask(task_id=task_id, entries=[
        worker_pb2.TaskEntry(request_id=request_id, token_ids=[5], sample=True) for request_id in tokens
    ])
    result = worker_pb2.TaskResult(task_id=task_id, tokens=[
        worker_pb2.SampledToken(request_id=request_id, token_id=token) for request_id, token in tokens.items()
    ])
    sampled.record(task, result)


def test_references_to_the_last_task_are_written_into_the_entries() -> None:
    sampled = SampledTokens(TPGroup(0, 1), "cpu")
    applied(sampled, 7, {"a": 11, "b": 12})
    task = worker_pb2.DecodeTask(task_id=8, entries=[
        worker_pb2.TaskEntry(request_id="b", sampled_in_task=7, sample=True),
        worker_pb2.TaskEntry(request_id="c", token_ids=[3, 4]),
        worker_pb2.TaskEntry(request_id="a", sampled_in_task=7, token_ids=[9]),
    ])
    assert sampled.resolve(task) == 2
    assert [list(entry.token_ids) for entry in task.entries] == [[12], [3, 4], [11, 9]]
    assert all(entry.sampled_in_task == 0 for entry in task.entries)


@pytest.mark.parametrize("entry, reset, problem", [
    (worker_pb2.TaskEntry(request_id="a", sampled_in_task=6), False, "the last task applied is 7"),
    (worker_pb2.TaskEntry(request_id="z", sampled_in_task=7), False, "sampled no token for it"),
    (worker_pb2.TaskEntry(request_id="a", sampled_in_task=7, new_request=worker_pb2.NewRequest()),
     False, "first entry"),
    (worker_pb2.TaskEntry(request_id="a", sampled_in_task=7), True, "first entry"),
])
def test_other_references_are_refused(entry, reset: bool, problem: str) -> None:
    sampled = SampledTokens(TPGroup(0, 1), "cpu")
    applied(sampled, 7, {"a": 11})
    good = worker_pb2.TaskEntry(request_id="b", token_ids=[5])
    task = worker_pb2.DecodeTask(task_id=8, reset=reset, entries=[good, entry])
    with pytest.raises(BadReference, match=rf"^entry 1 \(request '{entry.request_id}'\): .*{problem}"):
        sampled.resolve(task)
    assert [list(e.token_ids) for e in task.entries] == [[5], []]  # nothing written


def test_a_refused_task_leaves_the_last_applied_one() -> None:
    sampled = SampledTokens(TPGroup(0, 1), "cpu")
    applied(sampled, 7, {"a": 11})
    refused = worker_pb2.DecodeTask(task_id=8, entries=[worker_pb2.TaskEntry(request_id="a", token_ids=[1], sample=True)])
    sampled.record(refused, worker_pb2.TaskResult(task_id=8, error=worker_pb2.TaskError(code=3, message="no")))
    with pytest.raises(BadReference, match="the last task applied is 7"):
        sampled.resolve(worker_pb2.DecodeTask(task_id=9, entries=[
            worker_pb2.TaskEntry(request_id="a", sampled_in_task=8)]))
