"""Applies DecodeTasks on one rank: validate, update request state, run the model, sample.

Every rank runs the same executor over the same tasks. Validation reads only the task and the
rank's request table, which are identical on every rank, so all ranks reach the same verdict
without entering a collective: a malformed task is rejected whole on every rank, nothing of it
is applied, and no rank is left waiting in an all-reduce for the others.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from radixserve.constraints import Constraint
from radixserve.grammar_compiler import InvalidConstraint
from radixserve.sampling import SamplingParams
from worker_service.forward_batch import ForwardEntry, ModelInfo
from worker_service.metrics import WorkerMetrics
from worker_service.grammar import ConstraintMasks, RequestMatcher
from worker_service.request_state import RequestState, RequestTable
from worker_service.sampler import Sampler, SampleRow

log = logging.getLogger(__name__)

# gRPC status code numbers carried in TaskError.code.
INVALID_ARGUMENT = 3
INTERNAL = 13


@dataclass(slots=True, frozen=True)
class NewRequest:
    """Sent with a request's first entry: its sampling settings and cached prefix."""

    sampling: SamplingParams
    cached_token_ids: list[int]
    num_prompt_tokens: int
    constraint: Constraint | None = None


@dataclass(slots=True, frozen=True)
class TaskEntry:
    """One request's work in a step (see worker.proto TaskEntry)."""

    request_id: str
    token_ids: list[int]
    start_position: int
    page_ids: list[int]
    sample: bool
    new_request: NewRequest | None = None


@dataclass(slots=True, frozen=True)
class Task:
    """One step, the same on every rank: reset and releases first, then the entries."""

    task_id: int
    entries: list[TaskEntry]
    reset: bool = False
    release_request_ids: list[str] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class SampledToken:
    request_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True, frozen=True)
class TaskError:
    code: int
    message: str


@dataclass(slots=True, frozen=True)
class TaskResult:
    """Rank 0: one token per `sample=True` entry, in entry order. Other ranks: none."""

    task_id: int
    rank: int
    tokens: list[SampledToken] = field(default_factory=list)
    error: TaskError | None = None


class Runner(Protocol):
    """What the executor needs of a model runner (see forward_batch.py)."""

    info: ModelInfo

    def forward(self, entries: list[ForwardEntry]) -> torch.Tensor | None: ...


class InvalidTask(ValueError):
    """A task that breaks the protocol; its message says which entry and why."""


class Executor:
    """Owns one rank's request table and applies tasks to it, strictly one at a time."""

    def __init__(
        self, runner: Runner, sampler: Sampler | None = None, num_pages: int | None = None,
        metrics: WorkerMetrics | None = None,
        constraints: ConstraintMasks | None = None,
    ) -> None:
        """`num_pages`: the page count the whole TP group holds (the smallest over its ranks).

        Ranks with fewer KV heads fit more pages in the same budget; validating page ids against
        the group's count, not the rank's own, keeps every rank's verdict the same.
        `constraints`: rank 0's grammar masks (None: constrained requests are refused).
        """
        self.runner = runner
        self.info = runner.info if num_pages is None else replace(runner.info, num_pages=num_pages)
        self.requests = RequestTable()
        self.metrics = metrics
        # Only rank 0 samples; the other ranks never see logits.
        self.sampler: Sampler | None = None
        if self.info.rank == 0:
            self.sampler = sampler if sampler is not None else Sampler(self.info.device)
        self.constraints = constraints if self.info.rank == 0 else None

    def execute(self, task: Task) -> TaskResult:
        """Apply `task`; a malformed one comes back with an INVALID_ARGUMENT error, unapplied."""
        try:
            states = self._validate(task)
        except InvalidTask as exc:
            log.warning("task %d rejected: %s", task.task_id, exc)
            return TaskResult(task.task_id, self.info.rank, error=TaskError(INVALID_ARGUMENT, str(exc)))
        try:
            tokens = self._run(task, states)
        except Exception as exc:  # a broken runner, not a bad task: report it, apply nothing
            log.exception("task %d failed", task.task_id)
            return TaskResult(task.task_id, self.info.rank, error=TaskError(INTERNAL, f"forward failed: {exc}"))
        self._commit(task, states)
        return TaskResult(task.task_id, self.info.rank, tokens=tokens)

    def _run(self, task: Task, states: list[RequestState]) -> list[SampledToken]:
        """Forward the entries and, on rank 0, sample; reads the states and changes nothing but
        the constrained requests' matchers, which follow their sampled tokens (a matcher is
        synced to the output before each use, so it never depends on a task being committed)."""
        forward_entries = [
            ForwardEntry(
                token_ids=list(entry.token_ids),
                start_position=entry.start_position,
                page_table=state.page_table + list(entry.page_ids),
                sample=entry.sample,
            )
            for entry, state in zip(task.entries, states)
        ]
        started = time.monotonic()
        logits = self.runner.forward(forward_entries) if forward_entries else None
        if self.metrics is not None and forward_entries:
            self.metrics.forward_done([len(e.token_ids) for e in forward_entries], time.monotonic() - started)
        sampled = [(entry, state) for entry, state in zip(task.entries, states) if entry.sample]
        if self.sampler is None or not sampled:
            return []
        if logits is None or logits.dim() != 2 or logits.shape[0] != len(sampled):
            shape = None if logits is None else tuple(logits.shape)
            raise RuntimeError(f"runner returned logits {shape} for {len(sampled)} sampled entries")
        # The sampler sees the sequence including this step's tokens, before it is committed.
        rows = [
            SampleRow(state.sampling, state.token_ids + list(entry.token_ids), state.num_prompt_tokens)
            for entry, state in sampled
        ]
        constrained = [(row, state.matcher) for row, (_, state) in enumerate(sampled) if state.matcher]
        if constrained:
            for row, matcher in constrained:
                matcher.sync(rows[row].output_ids)
            logits = self.constraints.mask(logits, constrained)
        started = time.monotonic()
        samples = self.sampler.sample(logits, rows)
        if self.metrics is not None:
            self.metrics.sampler_done(time.monotonic() - started)
        for row, matcher in constrained:
            matcher.advance(samples[row].token_id)
        return [
            SampledToken(entry.request_id, sample.token_id, sample.logprob, sample.top_logprobs)
            for (entry, _), sample in zip(sampled, samples)
        ]

    def _validate(self, task: Task) -> list[RequestState]:
        """Check every entry against the table as it will be after reset and releases.

        Returns, per entry, the state the entry extends: the existing one, or a fresh (not
        yet registered) one for a new request. Nothing is mutated.
        """
        released = set(task.release_request_ids)
        seen: set[str] = set()
        states = []
        for index, entry in enumerate(task.entries):
            where = f"entry {index} (request {entry.request_id!r})"
            if not entry.request_id:
                raise InvalidTask(f"entry {index}: request_id is empty")
            if entry.request_id in seen:
                raise InvalidTask(f"{where}: request appears more than once in the task")
            seen.add(entry.request_id)
            known = None if task.reset or entry.request_id in released else self.requests.get(entry.request_id)
            if entry.new_request is not None:
                if known is not None:
                    raise InvalidTask(f"{where}: new_request for a request this rank already knows")
                state = self._new_state(entry.request_id, entry.new_request, where)
            elif known is None:
                raise InvalidTask(f"{where}: unknown request id (no new_request and not known to this rank)")
            else:
                state = known
            self._check_entry(entry, state, where)
            states.append(state)
        return states

    def _new_state(self, request_id: str, new: NewRequest, where: str) -> RequestState:
        problems = new.sampling.problems()
        if problems:
            raise InvalidTask(f"{where}: bad sampling: {'; '.join(problems)}")
        if not 0 <= new.num_prompt_tokens <= self.info.context_len:
            raise InvalidTask(
                f"{where}: num_prompt_tokens {new.num_prompt_tokens} is outside "
                f"[0, context length {self.info.context_len}]"
            )
        self._check_token_ids(new.cached_token_ids, f"{where}: cached_token_ids")
        return RequestState(
            request_id=request_id,
            sampling=new.sampling,
            num_prompt_tokens=new.num_prompt_tokens,
            token_ids=list(new.cached_token_ids),
            matcher=self._new_matcher(request_id, new.constraint, where),
        )

    def _new_matcher(self, request_id: str, constraint: Constraint | None, where: str) -> RequestMatcher | None:
        """Rank 0's matcher for a constrained request. Only rank 0 looks: the gateway has
        validated the constraint with the same library, so a refusal here means a misconfigured
        stack (no tokenizer in rank 0's model folder), and the router resets the group."""
        if constraint is None or self.info.rank != 0:
            return None
        if self.constraints is None:
            raise InvalidTask(f"{where}: constrained, but rank 0 has no tokenizer to apply constraints with")
        try:
            return self.constraints.new_matcher(request_id, constraint)
        except InvalidConstraint as exc:
            raise InvalidTask(f"{where}: {exc}") from exc

    def _check_entry(self, entry: TaskEntry, state: RequestState, where: str) -> None:
        info = self.info
        if not entry.token_ids:
            raise InvalidTask(f"{where}: token_ids is empty")
        self._check_token_ids(entry.token_ids, f"{where}: token_ids")
        if entry.start_position != state.num_written:
            written = "cached_token_ids holds" if entry.new_request is not None else "K/V is written for"
            raise InvalidTask(
                f"{where}: start_position {entry.start_position} does not follow the KV written: "
                f"{written} {state.num_written} tokens"
            )
        end = entry.start_position + len(entry.token_ids)
        if end > info.context_len:
            raise InvalidTask(
                f"{where}: positions up to {end - 1} exceed the context length {info.context_len}"
            )
        for page_id in entry.page_ids:
            if not 0 <= page_id < info.num_pages:
                raise InvalidTask(f"{where}: page id {page_id} is outside [0, {info.num_pages})")
        table = state.page_table + list(entry.page_ids)
        if len(set(table)) != len(table):
            duplicated = sorted({page for page in table if table.count(page) > 1})
            raise InvalidTask(f"{where}: page table repeats page ids {duplicated}")
        if len(table) * info.page_size < end:
            raise InvalidTask(
                f"{where}: {len(table)} pages of {info.page_size} tokens do not cover {end} tokens"
            )

    def _check_token_ids(self, token_ids: list[int], what: str) -> None:
        vocab = self.info.vocab_size
        for token_id in token_ids:
            if not 0 <= token_id < vocab:
                raise InvalidTask(f"{what}: token id {token_id} is outside the vocab [0, {vocab})")

    def _commit(self, task: Task, states: list[RequestState]) -> None:
        if task.reset:
            self.requests.clear()
        self.requests.release(task.release_request_ids)
        for entry, state in zip(task.entries, states):
            if entry.new_request is not None:
                self.requests.add(state)
            state.append(list(entry.token_ids), list(entry.page_ids))
