"""The executor over a fake runner: state, page tables, validation, seeded sampling.

The fake runner keeps a slot -> (position, token) map as its "KV pages" and computes each sampled
entry's logits from the whole context it reads back through the page table, so a wrong page
table, a wrong start position or a skipped write changes the logits or raises.
"""

from __future__ import annotations

import zlib
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.sampling import SamplingParams
from worker_service.executor import (
    INTERNAL,
    INVALID_ARGUMENT,
    Executor,
    NewRequest,
    Task,
    TaskEntry,
    TaskResult,
)
from worker.tiny_models import make_tiny_llama
from worker_service.forward_batch import ForwardEntry, ModelInfo
from worker_service.model_runner import ModelRunner, RunnerConfig
from worker_service.sampler import Sampler

VOCAB = 64
PAGE_SIZE = 4
NUM_PAGES = 32
CONTEXT_LEN = 96
GREEDY = SamplingParams()


def fake_logits(context: list[int]) -> torch.Tensor:
    """Deterministic logits that depend on every token of the context and its order."""
    seed = zlib.crc32(bytes(str(context), "ascii"))
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


class FakeRunner:
    def __init__(self, rank: int = 0, fail: bool = False) -> None:
        self.info = ModelInfo(
            model_name="fake", dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=NUM_PAGES,
            context_len=CONTEXT_LEN, vocab_size=VOCAB, eos_token_ids=[0], rank=rank, world_size=2,
        )
        self.slots: dict[int, tuple[int, int]] = {}
        self.calls: list[list[ForwardEntry]] = []
        self.fail = fail

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE

    def forward(self, entries: list[ForwardEntry]) -> torch.Tensor | None:
        if self.fail:
            raise RuntimeError("device fell over")
        self.calls.append(entries)
        rows = []
        for entry in entries:
            for offset, token in enumerate(entry.token_ids):
                position = entry.start_position + offset
                self.slots[self._slot(entry.page_table, position)] = (position, token)
            if entry.sample:
                context = []
                for position in range(entry.start_position + len(entry.token_ids)):
                    written_position, token = self.slots[self._slot(entry.page_table, position)]
                    assert written_position == position, "page table points at another sequence's K/V"
                    context.append(token)
                rows.append(fake_logits(context))
        if self.info.rank != 0 or not rows:
            return None
        return torch.stack(rows)


def first(
    request_id: str, token_ids: list[int], page_ids: list[int], *, params: SamplingParams = GREEDY,
    cached: list[int] | None = None, num_prompt: int | None = None, sample: bool = True,
) -> TaskEntry:
    cached = cached or []
    prompt_len = len(cached) + len(token_ids) if num_prompt is None else num_prompt
    return TaskEntry(
        request_id=request_id, token_ids=token_ids, start_position=len(cached), page_ids=page_ids,
        sample=sample, new_request=NewRequest(params, cached, prompt_len),
    )


def step(request_id: str, token_ids: list[int], start: int, page_ids: list[int] = (), sample: bool = True) -> TaskEntry:
    return TaskEntry(request_id, list(token_ids), start, list(page_ids), sample)


class Driver:
    """Numbers tasks and keeps the executor at hand."""

    def __init__(self, rank: int = 0, runner: FakeRunner | None = None) -> None:
        self.runner = runner or FakeRunner(rank)
        self.executor = Executor(self.runner, Sampler(seed=0) if rank == 0 else None)
        self.task_id = 0

    def run(self, *entries: TaskEntry, reset: bool = False, release: list[str] = ()) -> TaskResult:
        self.task_id += 1
        result = self.executor.execute(Task(self.task_id, list(entries), reset, list(release)))
        assert result.task_id == self.task_id
        return result

    def ok(self, *entries: TaskEntry, **kwargs) -> list[int]:
        result = self.run(*entries, **kwargs)
        assert result.error is None, result.error
        return [token.token_id for token in result.tokens]


def greedy_reference(prompt: list[int], num_tokens: int) -> list[int]:
    context, out = list(prompt), []
    for _ in range(num_tokens):
        token = int(fake_logits(context).argmax())
        out.append(token)
        context.append(token)
    return out


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


BAD_ENTRIES = {
    "unknown request": (step("zzz", [1], 0), "unknown request id"),
    "new_request for a known id": (first("a", [1], [2]), "already knows"),
    "page id out of range": (step("a", [7], 5, [32]), "page id 32 is outside [0, 32)"),
    "negative page id": (first("b", [1], [-1]), "page id -1 is outside"),
    "page repeated in the table": (step("a", [7], 5, [1]), "repeats page ids [1]"),
    "start behind the KV written": (step("a", [7], 4), "start_position 4 does not follow the KV written"),
    "start past the KV written": (step("a", [7], 6), "start_position 6 does not follow"),
    "start not after the cached prefix": (
        TaskEntry("b", [9], 0, [2], True, NewRequest(GREEDY, [1, 2], 3)), "cached_token_ids holds 2 tokens"
    ),
    "pages do not cover the tokens": (first("b", list(range(9)), [2, 3]), "2 pages of 4 tokens do not cover 9"),
    "empty token_ids": (step("a", [], 5), "token_ids is empty"),
    "past the context length": (
        first("b", [1, 2], list(range(2, 27)), cached=[1] * 95, num_prompt=90), "positions up to 96 exceed the context length 96"
    ),
    "bad sampling": (first("b", [1], [2], params=SamplingParams(top_p=0.0)), "bad sampling: top_p"),
    "token outside the vocab": (step("a", [64], 5), "token id 64 is outside the vocab [0, 64)"),
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
    assert result.error is not None and result.error.code == INVALID_ARGUMENT
    assert needle in result.error.message
    assert result.tokens == []
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
    assert result.error is None and result.tokens == [] and result.rank == 1
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


SEEDED = SamplingParams(temperature=1.0, top_k=20, seed=2024)


def seeded_run(prompt: list[int], num_tokens: int, chunk: int, companions: bool) -> list[int]:
    """Generate from `prompt` with SEEDED, prefilling `chunk` tokens a step, maybe with others."""
    driver = Driver()
    driver.executor.sampler = Sampler()  # a fresh shared generator with an unknown seed
    pages = list(range(NUM_PAGES - 1, NUM_PAGES - 1 - 8, -1))
    extras = [first(f"x{i}", [i + 1] * (i + 2), [i], params=SamplingParams(temperature=1.3)) for i in range(3)]
    tokens: list[int] = []
    position = 0
    while len(tokens) < num_tokens:
        if position < len(prompt):
            token_ids = prompt[position : position + chunk]
            done = position + len(token_ids) == len(prompt)
        else:
            token_ids, done = [tokens[-1]], True
        needed = -(-(position + len(token_ids)) // PAGE_SIZE) - -(-position // PAGE_SIZE)
        new_pages, pages = pages[:needed], pages[needed:]
        if position == 0:
            entry = first("s", token_ids, new_pages, params=SEEDED, num_prompt=len(prompt), sample=done)
        else:
            entry = step("s", token_ids, position, new_pages, sample=done)
        batch = [*extras, entry] if companions and position == 0 else [entry]
        result = driver.ok(*batch)
        if done:
            tokens.append(result[-1])
        position += len(token_ids)
    return tokens


def test_seeded_request_reproduces_alone_batched_and_chunked() -> None:
    prompt = [5, 17, 33, 2, 8, 60, 11]
    alone = seeded_run(prompt, 8, chunk=len(prompt), companions=False)
    assert seeded_run(prompt, 8, chunk=3, companions=True) == alone
    assert seeded_run(prompt, 8, chunk=1, companions=False) == alone
    assert len(set(alone)) > 1


def test_seeded_request_survives_retraction() -> None:
    prompt = [5, 17, 33, 2, 8, 60, 11]
    straight = seeded_run(prompt, 6, chunk=len(prompt), companions=False)
    driver = Driver()
    tokens = driver.ok(first("s", prompt, [0, 1], params=SEEDED))
    tokens += driver.ok(step("s", [tokens[-1]], 7))
    tokens += driver.ok(step("s", [tokens[-1]], 8, [2]))
    # Retracted, then resumed: only page 0 (prompt[:4]) survived in the prefix cache, so the rest of
    # the prompt and the three output tokens are computed again on fresh pages.
    resumed = first("s", prompt[4:] + tokens, [0, 5, 6], params=SEEDED, cached=prompt[:4], num_prompt=len(prompt))
    tokens += driver.ok(resumed, release=["s"])
    assert driver.executor.requests.get("s").num_output_tokens == 3
    while len(tokens) < 6:
        tokens += driver.ok(step("s", [tokens[-1]], len(prompt) + len(tokens) - 1))
    assert tokens == straight


def test_group_page_count_bounds_page_ids() -> None:
    runner = FakeRunner()
    executor = Executor(runner, Sampler(seed=0), num_pages=8)
    assert executor.info.num_pages == 8 and runner.info.num_pages == NUM_PAGES
    result = executor.execute(Task(1, [first("a", [1], [8])]))
    assert result.error.code == INVALID_ARGUMENT and "page id 8 is outside [0, 8)" in result.error.message
    assert executor.execute(Task(2, [first("a", [1], [7])])).error is None


def test_seeded_tokens_with_a_real_model_do_not_depend_on_the_batch(tmp_path) -> None:
    runner = ModelRunner(RunnerConfig(make_tiny_llama(tmp_path / "llama"), page_size=4, kv_cache_bytes=1 << 20))
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=77)
    prompt = [5, 17, 33, 2, 8, 60, 11]

    def generate(companions: bool, chunk: int) -> list[int]:
        executor = Executor(runner, Sampler())
        extras = [first(f"x{i}", [9 + i] * (3 + i), [20 + 3 * i, 21 + 3 * i, 22 + 3 * i], params=SamplingParams(temperature=0.9))
                  for i in range(2)] if companions else []
        head = first("s", prompt[:chunk], [0], params=params, num_prompt=len(prompt), sample=False)
        assert executor.execute(Task(1, [*extras, head], reset=True)).error is None
        result = executor.execute(Task(2, [step("s", prompt[chunk:], chunk, [1, 2])]))
        tokens = [result.tokens[0].token_id]
        extra_positions = {f"x{i}": 3 + i for i in range(2)} if companions else {}
        for task_id in range(3, 8):
            entries = [step("s", [tokens[-1]], len(prompt) + len(tokens) - 1)]
            for request_id, position in extra_positions.items():
                entries.insert(0, step(request_id, [1], position))
                extra_positions[request_id] += 1
            result = executor.execute(Task(task_id, entries))
            assert result.error is None, result.error
            tokens.append(result.tokens[-1].token_id)
        return tokens

    alone = generate(companions=False, chunk=4)
    assert generate(companions=True, chunk=2) == alone
    assert len(set(alone)) > 1


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
            assert result.error is not None and result.error.code == INVALID_ARGUMENT, corruption
            assert snapshot(driver.executor) == before
            continue
        assert result.error is None, result.error
        assert len(result.tokens) == sum(entry.sample for entry in entries)
        for request_id in release:
            free += pages.pop(request_id)
            del written[request_id]
        for request_id, (grant, num_tokens) in grants.items():
            free = [p for p in free if p not in grant]
            pages.setdefault(request_id, []).extend(grant)
            written[request_id] = written.get(request_id, 0) + num_tokens
        assert {r: len(t) for r, (t, _) in snapshot(driver.executor).items()} == written


def _corrupt(entries: list[TaskEntry], index: int, corruption: str, live: list[str]) -> list[TaskEntry]:
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
        entries[index] = replace(entry, start_position=entry.start_position + 1)
    elif corruption == "token outside vocab":
        entries[index] = replace(entry, token_ids=[*entry.token_ids[:-1], VOCAB])
    elif corruption == "page outside pool":
        entries[index] = replace(entry, page_ids=[*entry.page_ids, NUM_PAGES])
    elif corruption == "empty":
        entries[index] = replace(entry, token_ids=[])
    return entries
