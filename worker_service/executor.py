"""Applies DecodeTasks on one rank: validate, grow request state, run the model, sample.

The executor works on the wire messages themselves (`worker_pb2.DecodeTask` in,
`worker_pb2.TaskResult` out); there is no second copy of them. A task goes through three steps:

1. `_validate` reads the task and the rank's request table, which are identical on every rank,
   so all ranks reach the same verdict without entering a collective: a malformed task is
   rejected whole on every rank, nothing of it is applied, and no rank is left waiting in an
   all-reduce for the others. New requests get a fresh (not yet registered) `RequestState`.
2. `_grow` appends each entry's new tokens and pages to its state in place, so the step costs
   what is new, never the request's whole length; `_forward` builds the `ForwardEntry` batch
   over those states, runs the model and, on rank 0, samples.
3. On success the reset, releases and new states are committed; if the forward pass fails, the
   states are cut back to where they were, so a failed task changes nothing either.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Protocol

import torch

from radixserve import constraints, sampling
from radixserve.grammar_compiler import InvalidConstraint
from radixserve.v1 import generation_pb2, worker_pb2
from worker_service.draft_verify import num_accepted, verify_rows
from worker_service.embedding import finish_embedding, pooling_problem
from worker_service.forward_batch import ForwardEntry, StepOutput
from worker_service.grammar import ConstraintMasks, RequestMatcher
from worker_service.metrics import WorkerMetrics
from worker_service.request_state import RequestState, RequestTable
from worker_service.sampling import Sample, Sampler

log = logging.getLogger(__name__)

# gRPC status code numbers carried in TaskError.code.
INVALID_ARGUMENT = 3
INTERNAL = 13


class Runner(Protocol):
    """What the executor needs of a model runner (see forward_batch.py)."""

    info: worker_pb2.GetWorkerInfoResponse

    def forward(self, entries: list[ForwardEntry]) -> torch.Tensor | None: ...

    def forward_step(self, entries: list[ForwardEntry]) -> StepOutput: ...


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
        `sampler`: rank 0's (None: PyTorch's ops on the rank's device; the worker passes its
        backend's, `Backend.new_sampler`).
        """
        self.runner = runner
        self.info = worker_pb2.GetWorkerInfoResponse()
        self.info.CopyFrom(runner.info)
        if num_pages is not None:
            self.info.num_pages = num_pages
        # The limits every entry is checked against, as ints (a proto field read costs more).
        self._vocab_size, self._context_len = self.info.vocab_size, self.info.context_len
        self._num_pages, self._page_size = self.info.num_pages, self.info.page_size
        self.requests = RequestTable()
        self.metrics = metrics
        # Only rank 0 samples; the other ranks never see logits.
        self.sampler: Sampler | None = None
        if self.info.rank == 0:
            self.sampler = sampler if sampler is not None else Sampler(self.info.device)
        self.constraints = constraints if self.info.rank == 0 else None

    def execute(self, task: worker_pb2.DecodeTask) -> worker_pb2.TaskResult:
        """Apply `task`; a malformed one comes back with an INVALID_ARGUMENT error, unapplied."""
        result = worker_pb2.TaskResult(task_id=task.task_id, rank=self.info.rank)
        try:
            states = self._validate(task)
        except InvalidTask as exc:
            log.warning("task %d rejected: %s", task.task_id, exc)
            result.error.code, result.error.message = INVALID_ARGUMENT, str(exc)
            return result
        marks = [
            state.append_entry(entry.start_position, entry.token_ids, entry.page_ids, entry.num_draft_tokens)
            for entry, state in zip(task.entries, states)
        ]
        try:
            self._forward(task, states, result)
        except Exception as exc:  # a broken runner, not a bad task: report it, apply nothing
            log.exception("task %d failed", task.task_id)
            for state, mark in zip(states, marks):
                state.restore(mark)
            del result.tokens[:]
            result.error.code, result.error.message = INTERNAL, f"forward failed: {exc}"
            return result
        self._commit(task, states)
        return result

    def _forward(self, task: worker_pb2.DecodeTask, states: list[RequestState], result: worker_pb2.TaskResult) -> None:
        """Forward the entries over their grown states and, on rank 0, add the sampled tokens to
        `result`. Changes nothing else but the constrained requests' matchers, which follow
        their sampled tokens (a matcher is synced to the output before each use, so it never
        depends on a task being committed)."""
        # An embedding entry never samples: rank 0 pools its hidden states instead.
        batch = [
            ForwardEntry(list(entry.token_ids), entry.start_position, state.page_table,
                         entry.sample and not state.pooling, 1 + entry.num_draft_tokens,
                         state.pooling, entry.sample and bool(state.pooling))
            for entry, state in zip(task.entries, states)
        ]
        pooling = any(state.pooling for state in states)
        started = time.monotonic()
        pooled: list[torch.Tensor | None] = []
        if pooling:
            output = self.runner.forward_step(batch)
            logits, pooled = output.logits, output.pooled
        else:
            logits = self.runner.forward(batch) if batch else None
        if self.metrics is not None and batch:
            self.metrics.forward_done([len(e.token_ids) for e in batch], time.monotonic() - started)
        if self.sampler is None:
            return
        sampled = [(entry, state) for entry, state in zip(task.entries, states)
                   if entry.sample and not state.pooling]
        self._sample(logits, sampled, result)
        if pooling:
            self._add_embeddings(task, states, pooled, result)

    def _add_embeddings(self, task: worker_pb2.DecodeTask, states: list[RequestState],
                        pooled: list[torch.Tensor | None], result: worker_pb2.TaskResult) -> None:
        """Rank 0: fold the step's pooled rows into the embedding requests' states, and put the
        finished embeddings among the sampled tokens, everything in entry order."""
        made = {}
        for token in result.tokens:
            made[token.request_id] = copy = worker_pb2.SampledToken()
            copy.CopyFrom(token)
        ordered = []
        for entry, state, rows in zip(task.entries, states, pooled):
            if state.pooling:
                token = finish_embedding(state, rows, len(entry.token_ids), entry.sample)
                if token is not None:
                    made[entry.request_id] = worker_pb2.SampledToken(request_id=entry.request_id, embedding=token)
            if entry.sample:
                ordered.append(made[entry.request_id])
        del result.tokens[:]
        result.tokens.extend(ordered)

    def _sample(self, logits: torch.Tensor | None, sampled: list[tuple[worker_pb2.TaskEntry, RequestState]],
                result: worker_pb2.TaskResult) -> None:
        """Rank 0: sample the generation entries' tokens into `result`."""
        if not sampled:
            return
        # The states already hold this step's tokens: penalties and seeds see the sequence so far.
        # One row per verified position (one for an entry without drafts).
        entry_rows = [verify_rows(state, entry.num_draft_tokens) for entry, state in sampled]
        rows = [row for group in entry_rows for row in group]
        if logits is None or logits.dim() != 2 or logits.shape[0] != len(rows):
            shape = None if logits is None else tuple(logits.shape)
            raise RuntimeError(f"runner returned logits {shape} for {len(rows)} sampled positions")
        firsts = list(itertools.accumulate((len(group) for group in entry_rows), initial=0))
        constrained = [
            (first + j, state.matcher, row.output_ids)
            for first, group, (_, state) in zip(firsts, entry_rows, sampled) if state.matcher
            for j, row in enumerate(group)
        ]
        if constrained:
            logits = self.constraints.mask(logits, constrained)
        started = time.monotonic()
        samples = self.sampler.sample(logits, rows)
        if self.metrics is not None:
            self.metrics.sampler_done(time.monotonic() - started)
        add = result.tokens.add
        for first, group, (entry, state) in zip(firsts, entry_rows, sampled):
            count = 0
            if num_drafts := entry.num_draft_tokens:
                token_ids = entry.token_ids
                count = num_accepted(list(token_ids[len(token_ids) - num_drafts:]), samples[first:])
            final = samples[first + count]
            if state.matcher is not None:  # back to the accepted tokens, then the sampled one
                state.matcher.sync(group[count].output_ids)
                state.matcher.advance(final.token_id)
                if (error := state.matcher.error()) is not None:
                    result.constraint_failures.add(request_id=entry.request_id, message=error)
            token = add(request_id=entry.request_id, token_id=final.token_id, num_accepted_drafts=count)
            if final.logprob is not None:
                _add_logprobs(token, final)
                for sample in samples[first : first + count]:
                    _add_logprobs(token.accepted_logprobs.add(token_id=sample.token_id), sample)

    def _validate(self, task: worker_pb2.DecodeTask) -> list[RequestState]:
        """Check every entry against the table as it will be after reset and releases.

        Returns, per entry, the state the entry extends: the existing one, or a fresh (not
        yet registered) one for a new request. Nothing is mutated.
        """
        released = set(task.release_request_ids)
        seen: set[str] = set()
        states = []
        requests = None if task.reset else self.requests
        for index, entry in enumerate(task.entries):
            request_id = entry.request_id
            if not request_id:
                raise InvalidTask(f"entry {index}: request_id is empty")
            if request_id in seen:
                raise InvalidTask(f"{entry_name(index, request_id)}: request appears more than once in the task")
            seen.add(request_id)
            known = None if requests is None or request_id in released else requests.get(request_id)
            is_new = entry.HasField("new_request")
            if is_new:
                if known is not None:
                    raise InvalidTask(
                        f"{entry_name(index, request_id)}: new_request for a request this rank already knows")
                state = self._new_state(request_id, entry.new_request, entry_name(index, request_id))
            elif known is None:
                raise InvalidTask(
                    f"{entry_name(index, request_id)}: unknown request id (no new_request and not known to this rank)")
            else:
                state = known
            problem = self._entry_problem(entry, state, is_new)
            if problem is not None:
                raise InvalidTask(f"{entry_name(index, request_id)}: {problem}")
            states.append(state)
        return states

    def _new_state(self, request_id: str, new: worker_pb2.NewRequest, where: str) -> RequestState:
        params = sampling.from_proto(new.sampling)
        problems = params.problems()
        if problems:
            raise InvalidTask(f"{where}: bad sampling: {'; '.join(problems)}")
        if not 0 <= new.num_prompt_tokens <= self.info.context_len:
            raise InvalidTask(
                f"{where}: num_prompt_tokens {new.num_prompt_tokens} is outside "
                f"[0, context length {self.info.context_len}]"
            )
        for what, token_ids in (("cached_token_ids", new.cached_token_ids),
                                ("logit_bias", [token_id for token_id, _ in params.logit_bias])):
            problem = self._token_problem(token_ids)
            if problem is not None:
                raise InvalidTask(f"{where}: {what}: {problem}")
        problem = pooling_problem(new)
        if problem is not None:
            raise InvalidTask(f"{where}: {problem}")
        state = RequestState(request_id, params, new.num_prompt_tokens, pooling=new.pooling.mode,
                             normalize=new.pooling.normalize)
        state.append(new.cached_token_ids, ())
        state.matcher = self._new_matcher(request_id, new, where)
        return state

    def _new_matcher(self, request_id: str, new: worker_pb2.NewRequest, where: str) -> RequestMatcher | None:
        """Rank 0's matcher for a constrained request. Only rank 0 looks: the gateway has
        validated the constraint with the same library, so a refusal here means a misconfigured
        stack (no tokenizer in rank 0's model folder), and the router resets the group."""
        constraint = constraints.from_proto(new.constraint)
        if constraint is None or self.info.rank != 0:
            return None
        if self.constraints is None:
            raise InvalidTask(f"{where}: constrained, but rank 0 has no tokenizer to apply constraints with")
        try:
            return self.constraints.new_matcher(request_id, constraint)
        except InvalidConstraint as exc:
            raise InvalidTask(f"{where}: {exc}") from exc

    def _entry_problem(self, entry: worker_pb2.TaskEntry, state: RequestState, is_new: bool) -> str | None:
        """What is wrong with `entry` against `state`, or None. Costs what the entry adds (its
        tokens and pages), not what the state holds: a decode entry (one token, no new page)
        is a few comparisons, as it runs for every row of every step."""
        token_ids = entry.token_ids
        num_tokens = len(token_ids)
        if not num_tokens:
            return "token_ids is empty"
        problem = self._token_problem(token_ids)
        if problem is not None:
            return f"token_ids: {problem}"
        start, num_drafts = entry.start_position, entry.num_draft_tokens
        # After a speculative entry the rank does not know how many drafts were kept: the next
        # entry may start anywhere from the first draft on (see worker.proto TaskEntry).
        num_written = len(state.token_ids)
        if not num_written - state.num_unverified <= start <= num_written:
            written = "cached_token_ids holds" if is_new else "K/V is written for"
            unverified = f" ({state.num_unverified} of them drafts)" if state.num_unverified else ""
            return (f"start_position {start} does not follow the KV written: "
                    f"{written} {num_written} tokens{unverified}")
        if num_drafts:
            if not 0 <= num_drafts < num_tokens:
                return f"num_draft_tokens {num_drafts} must be in [0, {num_tokens})"
            if not entry.sample:
                return "drafts to verify, but sample is false"
            if state.pooling:
                return "drafts for an embedding request"
        end = start + num_tokens
        if state.pooling and entry.sample and end != state.num_prompt_tokens:
            return "an embedding request samples only where its prompt ends"
        if end > self._context_len:
            return f"positions up to {end - 1} exceed the context length {self._context_len}"
        page_ids = entry.page_ids
        if page_ids:
            limit = self._num_pages
            if min(page_ids) < 0 or max(page_ids) >= limit:
                page_id = next(p for p in page_ids if not 0 <= p < limit)
                return f"page id {page_id} is outside [0, {limit})"
            new_pages = set(page_ids)
            if len(new_pages) != len(page_ids) or not state.page_set.isdisjoint(new_pages):
                repeated = sorted(p for p in new_pages if p in state.page_set or list(page_ids).count(p) > 1)
                return f"page table repeats page ids {repeated}"
        num_pages = len(state.page_table) + len(page_ids)
        if num_pages * self._page_size < end:
            return f"{num_pages} pages of {self._page_size} tokens do not cover {end} tokens"
        return None

    def _token_problem(self, token_ids) -> str | None:
        """The first token id outside the vocab, said, or None (the bounds checked in C first)."""
        vocab = self._vocab_size
        if len(token_ids) == 1:  # a decode row: no iterator over the proto's field
            if 0 <= token_ids[0] < vocab:
                return None
        elif not token_ids or (0 <= min(token_ids) and max(token_ids) < vocab):
            return None
        token_id = next(t for t in token_ids if not 0 <= t < vocab)
        return f"token id {token_id} is outside the vocab [0, {vocab})"

    def _commit(self, task: worker_pb2.DecodeTask, states: list[RequestState]) -> None:
        if task.reset:
            self.requests.clear()
        self.requests.release(task.release_request_ids)
        for entry, state in zip(task.entries, states):
            if entry.HasField("new_request"):
                self.requests.add(state)


def entry_name(index: int, request_id: str) -> str:
    """How a refused task's message names one of its entries (built only when one is refused;
    sampled_tokens.py names them so too)."""
    return f"entry {index} (request {request_id!r})"


def _add_logprobs(token: worker_pb2.SampledToken | generation_pb2.TokenLogprob, sample: Sample) -> None:
    """A sampled token's logprob and top alternatives (when asked) onto its message."""
    if sample.logprob is not None:
        token.logprob = sample.logprob
    for token_id, logprob in sample.top_logprobs or ():
        token.top_logprobs.add(token_id=token_id, logprob=logprob)
