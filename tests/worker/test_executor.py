"""The executor over a fake runner: state, page tables, validation and the task protocol.

The fake runner (`executor_fakes`) reads every sampled entry's context back through its page
table, so a wrong page table, start position or skipped write changes the logits or raises.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.sampling import SamplingParams
from radixserve.v1 import worker_pb2
from worker.executor_fakes import (
    CONTEXT_LEN,
    GREEDY,
    NUM_PAGES,
    PAGE_SIZE,
    VOCAB,
    Driver,
    FakeRunner,
    entry,
    error_of,
    first,
    greedy_reference,
    new_request,
    step,
    task,
)
from worker_service.executor import INTERNAL, INVALID_ARGUMENT, Executor
from worker_service.forward_batch import ForwardEntry
from worker_service.sampling import Sampler


def test_prefill_then_decodes_follow_the_page_table() -> None:
    driver = Driver()
    prompt = [3, 14, 15, 9, 26, 5]
    expected = greedy_reference(prompt, 5)
    tokens = driver.ok(first("a", prompt, [5, 9]))
    for index in range(1, 5):
        position = len(prompt) + index - 1
        pages = [2] if position == 8 else []  # the third page is needed at position 8
        tokens += driver.ok(step("a", [tokens[-1]], position, pages))
    assert tokens == expected
    last = driver.runner.calls[-1][0]
    assert last == ForwardEntry([tokens[-2]], 9, [5, 9, 2], True)
    state = driver.executor.requests.get("a")
    assert state.num_written == 10 and state.page_table == [5, 9, 2] and state.num_output_tokens == 4


def test_chunked_prefill_and_cached_prefix_are_not_recomputed() -> None:
    driver = Driver()
    prompt = list(range(10, 20))
    # Chunked prefill: no token until the last chunk.
    assert driver.ok(first("a", prompt[:6], [0, 1], sample=False, num_prompt=10)) == []
    tokens = driver.ok(step("a", prompt[6:], 6, [4]))
    assert tokens == greedy_reference(prompt, 1)
    # Request b shares a's first two pages (8 tokens) as a cached prefix and computes only the rest.
    other = prompt[:8] + [40, 41, 42]
    b_tokens = driver.ok(first("b", other[8:], [0, 1, 7], cached=other[:8]), release=["a"])
    assert driver.runner.calls[-1] == [ForwardEntry([40, 41, 42], 8, [0, 1, 7], True)]
    assert b_tokens == greedy_reference(other, 1)
    assert driver.executor.requests.get("b").token_ids == other
    assert "a" not in driver.executor.requests


def known_request(driver: Driver) -> int:
    """Request 'a': 5 prompt tokens on pages 0 and 1; returns its first token."""
    return driver.ok(first("a", [1, 2, 3, 4, 5], [0, 1]))[0]


def with_drafts(task_entry, num_drafts: int):
    task_entry.num_draft_tokens = num_drafts
    return task_entry


BAD_ENTRIES = {
    "unknown request": (step("zzz", [1], 0), "unknown request id"),
    "new_request for a known id": (first("a", [1], [2]), "already knows"),
    "page id out of range": (step("a", [7], 5, [32]), "page id 32 is outside [0, 32)"),
    "negative page id": (first("b", [1], [-1]), "page id -1 is outside"),
    "page repeated in the table": (step("a", [7], 5, [1]), "repeats page ids [1]"),
    "start behind the KV written": (step("a", [7], 4), "start_position 4 does not follow the KV written"),
    "start past the KV written": (step("a", [7], 6), "start_position 6 does not follow"),
    "start not after the cached prefix": (
        entry("b", [9], 0, [2], True, new_request(GREEDY, [1, 2], 3)), "cached_token_ids holds 2 tokens"
    ),
    "pages do not cover the tokens": (first("b", list(range(9)), [2, 3]), "2 pages of 4 tokens do not cover 9"),
    "empty token_ids": (step("a", [], 5), "token_ids is empty"),
    "past the context length": (
        first("b", [1, 2], list(range(2, 27)), cached=[1] * 95, num_prompt=90), "positions up to 96 exceed the context length 96"
    ),
    "bad sampling": (first("b", [1], [2], params=SamplingParams(top_p=0.0)), "bad sampling: top_p"),
    "token outside the vocab": (step("a", [64], 5), "token id 64 is outside the vocab [0, 64)"),
    "negative decode token": (step("a", [-2], 5), "entry 1 (request 'a'): token_ids: token id -2 is outside"),
    "the first bad token of a prompt": (first("b", [1, 70, 2, 90], [2]), "token id 70 is outside the vocab"),
    "the first bad page of several": (first("b", [1] * 9, [2, 40, 3, -5]), "page id 40 is outside [0, 32)"),
    "negative drafts": (with_drafts(step("a", [7, 8], 5), -1), "num_draft_tokens -1 must be in [0, 2)"),
    "cached token outside the vocab": (first("b", [1], [2, 3], cached=[-3]), "cached_token_ids: token id -3"),
    "empty request id": (first("", [1], [2]), "request_id is empty"),
}


@pytest.mark.parametrize("case", list(BAD_ENTRIES))
def test_malformed_task_is_rejected_whole_and_the_next_one_runs(case: str) -> None:
    driver = Driver()
    token = known_request(driver)
    num_calls = len(driver.runner.calls)
    bad, needle = BAD_ENTRIES[case]
    # A good entry for a new request rides along: it must not be applied either.
    result = driver.run(first("good", [8, 8], [9]), bad, release=["a"] if case == "unknown request" else [])
    assert error_of(result) is not None and result.error.code == INVALID_ARGUMENT
    assert needle in result.error.message
    assert list(result.tokens) == []
    assert len(driver.runner.calls) == num_calls, "a rejected task must not reach the model"
    assert "good" not in driver.executor.requests
    # Nothing changed: 'a' (even when the bad task released it) continues where it was.
    assert driver.ok(step("a", [token], 5)) == greedy_reference([1, 2, 3, 4, 5], 2)[1:]
    assert driver.ok(first("good", [8, 8], [9])) == greedy_reference([8, 8], 1)


def test_same_request_twice_in_one_task_is_rejected() -> None:
    driver = Driver()
    token = known_request(driver)
    result = driver.run(step("a", [token], 5), step("a", [token], 6))
    assert result.error.code == INVALID_ARGUMENT and "more than once" in result.error.message


def test_release_and_reset_apply_before_entries() -> None:
    driver = Driver()
    known_request(driver)
    # Released and started again in the same task: the id is free for a new_request.
    assert driver.ok(first("a", [7, 7, 7], [3]), release=["a", "never-seen"]) == greedy_reference([7, 7, 7], 1)
    assert driver.executor.requests.get("a").page_table == [3]
    result = driver.run(step("a", [1], 3), reset=True)
    assert result.error.code == INVALID_ARGUMENT and "unknown request id" in result.error.message
    driver.ok(reset=True)
    assert len(driver.executor.requests) == 0


def test_other_ranks_acknowledge_without_tokens() -> None:
    driver = Driver(rank=1)
    result = driver.run(first("a", [1, 2, 3], [0]))
    assert error_of(result) is None and list(result.tokens) == [] and result.rank == 1
    assert driver.runner.calls == [[ForwardEntry([1, 2, 3], 0, [0], True)]]
    assert driver.executor.requests.get("a").num_written == 3
    bad = driver.run(step("a", [1], 0))
    assert bad.error.code == INVALID_ARGUMENT and bad.rank == 1


def test_runner_failure_is_internal_and_applies_nothing() -> None:
    runner = FakeRunner()
    driver = Driver(runner=runner)
    known_request(driver)
    runner.fail = True
    result = driver.run(step("a", [1], 5), first("b", [1], [4]))
    assert result.error.code == INTERNAL and "device fell over" in result.error.message
    assert driver.executor.requests.get("a").num_written == 5 and "b" not in driver.executor.requests


def test_failed_step_cuts_the_grown_state_back() -> None:
    """State grows in place before the forward pass; a failure must take the tokens and pages
    back, so the same step can be sent again (its new page is not "repeated")."""
    runner = FakeRunner()
    driver = Driver(runner=runner)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    token = driver.ok(first("a", prompt, [0, 1]))[0]
    runner.fail = True
    assert error_of(driver.run(step("a", [token], 8, [6]))).code == INTERNAL
    state = driver.executor.requests.get("a")
    assert (state.token_ids, state.page_table, state.page_set) == (prompt, [0, 1], {0, 1})
    runner.fail = False
    assert [token, *driver.ok(step("a", [token], 8, [6]))] == greedy_reference(prompt, 2)


def test_group_page_count_bounds_page_ids() -> None:
    runner = FakeRunner()
    executor = Executor(runner, Sampler(seed=0), num_pages=8)
    assert executor.info.num_pages == 8 and runner.info.num_pages == NUM_PAGES
    result = executor.execute(task(1, [first("a", [1], [8])]))
    assert result.error.code == INVALID_ARGUMENT and "page id 8 is outside [0, 8)" in result.error.message
    assert error_of(executor.execute(task(2, [first("a", [1], [7])]))) is None


def snapshot(executor: Executor) -> dict[str, tuple[list[int], list[int]]]:
    return {state.request_id: (list(state.token_ids), list(state.page_table)) for state in executor.requests}


CORRUPTIONS = ["start ahead", "token outside vocab", "page outside pool", "unknown id", "known id as new", "empty"]


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_task_sequences_keep_state_consistent(data: st.DataObject) -> None:
    """Random valid steps, some corrupted: corrupted ones change nothing, valid ones never fail."""
    driver = Driver()
    written: dict[str, int] = {}  # the test's own view: request -> tokens written
    pages: dict[str, list[int]] = {}
    free = list(range(NUM_PAGES))
    next_id = 0
    for _ in range(10):
        release = data.draw(st.lists(st.sampled_from(sorted(written)), unique=True, max_size=2)) if written else []
        view_written = {r: n for r, n in written.items() if r not in release}
        view_free = free + [p for r in release for p in pages[r]]
        entries, grants = [], {}
        for request_id in data.draw(st.lists(st.sampled_from([*sorted(view_written), "new"]), max_size=3)):
            if request_id == "new":
                request_id, next_id = f"n{next_id}", next_id + 1
            if request_id in grants:
                continue
            start = view_written.get(request_id, 0)
            num_tokens = data.draw(st.integers(1, 6))
            have = len(pages.get(request_id, [])) if request_id in view_written else 0
            need = max(0, -(-(start + num_tokens) // PAGE_SIZE) - have)
            if need > len(view_free) or start + num_tokens > CONTEXT_LEN:
                continue
            grant, view_free = view_free[:need], view_free[need:]
            grants[request_id] = (grant, num_tokens)
            tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=num_tokens, max_size=num_tokens))
            sample = data.draw(st.booleans())
            if request_id in view_written:
                entries.append(step(request_id, tokens, start, grant, sample))
            else:
                entries.append(first(request_id, tokens, grant, sample=sample, num_prompt=num_tokens))
        corruption = data.draw(st.sampled_from([None, None, *CORRUPTIONS]))
        if corruption in ("start ahead", "token outside vocab", "page outside pool", "empty") and not entries:
            corruption = None
        if corruption == "known id as new" and not view_written:
            corruption = None
        if corruption is not None:
            index = data.draw(st.integers(0, max(0, len(entries) - 1)))
            entries = _corrupt(entries, index, corruption, sorted(view_written))
        before = snapshot(driver.executor)
        result = driver.run(*entries, release=release)
        if corruption is not None:
            assert error_of(result) is not None and result.error.code == INVALID_ARGUMENT, corruption
            assert snapshot(driver.executor) == before
            continue
        assert error_of(result) is None, result.error
        assert len(result.tokens) == sum(entry.sample for entry in entries)
        for request_id in release:
            free += pages.pop(request_id)
            del written[request_id]
        for request_id, (grant, num_tokens) in grants.items():
            free = [p for p in free if p not in grant]
            pages.setdefault(request_id, []).extend(grant)
            written[request_id] = written.get(request_id, 0) + num_tokens
        assert {r: len(t) for r, (t, _) in snapshot(driver.executor).items()} == written


def _changed(entry: worker_pb2.TaskEntry, **fields) -> worker_pb2.TaskEntry:
    changed = worker_pb2.TaskEntry()
    changed.CopyFrom(entry)
    for name, value in fields.items():
        if isinstance(value, list):
            changed.ClearField(name)
            getattr(changed, name).extend(value)
        else:
            setattr(changed, name, value)
    return changed


def _corrupt(entries: list[worker_pb2.TaskEntry], index: int, corruption: str, live: list[str]) -> list[worker_pb2.TaskEntry]:
    entries = list(entries)
    if corruption == "unknown id":
        return [*entries, step("never-started", [1], 0)]
    if corruption == "known id as new":
        taken = {entry.request_id for entry in entries}
        request_id = next((r for r in live if r not in taken), None)
        if request_id is None:
            return [*entries, step("never-started", [1], 0)]
        return [*entries, first(request_id, [1], [])]
    entry = entries[index]
    if corruption == "start ahead":
        entries[index] = _changed(entry, start_position=entry.start_position + 1)
    elif corruption == "token outside vocab":
        entries[index] = _changed(entry, token_ids=[*entry.token_ids[:-1], VOCAB])
    elif corruption == "page outside pool":
        entries[index] = _changed(entry, page_ids=[*entry.page_ids, NUM_PAGES])
    elif corruption == "empty":
        entries[index] = _changed(entry, token_ids=[])
    return entries
