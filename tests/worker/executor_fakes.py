"""A fake model runner and task helpers for the executor's tests.

The fake runner keeps a slot -> (position, token) map as its "KV pages" and computes each sampled
entry's logits from the whole context it reads back through the page table, so a wrong page
table, a wrong start position or a skipped write changes the logits or raises.
"""

from __future__ import annotations

import zlib

import torch

from radixserve import constraints as constraint_values
from radixserve import sampling
from radixserve.constraints import Constraint
from radixserve.sampling import SamplingParams
from radixserve.v1 import worker_pb2
from worker_service.executor import Executor
from worker_service.forward_batch import ForwardEntry
from worker_service.sampling import Sampler

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
        self.info = worker_pb2.GetWorkerInfoResponse(
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


def new_request(
    params: SamplingParams, cached: list[int], num_prompt: int, constraint: Constraint | None = None
) -> worker_pb2.NewRequest:
    return worker_pb2.NewRequest(
        sampling=sampling.to_proto(params), cached_token_ids=cached, num_prompt_tokens=num_prompt,
        constraint=constraint_values.to_proto(constraint),
    )


def entry(
    request_id: str, token_ids: list[int], start: int, page_ids: list[int], sample: bool,
    new: worker_pb2.NewRequest | None = None,
) -> worker_pb2.TaskEntry:
    return worker_pb2.TaskEntry(
        request_id=request_id, token_ids=token_ids, start_position=start, page_ids=page_ids, sample=sample,
        new_request=new,
    )


def task(
    task_id: int, entries: list[worker_pb2.TaskEntry], reset: bool = False, release_request_ids: list[str] = (),
) -> worker_pb2.DecodeTask:
    return worker_pb2.DecodeTask(task_id=task_id, entries=entries, reset=reset, release_request_ids=release_request_ids)


def error_of(result: worker_pb2.TaskResult) -> worker_pb2.TaskError | None:
    """The result's error, None when the task was applied."""
    return result.error if result.HasField("error") else None


def first(
    request_id: str, token_ids: list[int], page_ids: list[int], *, params: SamplingParams = GREEDY,
    cached: list[int] | None = None, num_prompt: int | None = None, sample: bool = True,
) -> TaskEntry:
    cached = cached or []
    prompt_len = len(cached) + len(token_ids) if num_prompt is None else num_prompt
    return entry(request_id, token_ids, len(cached), page_ids, sample, new_request(params, cached, prompt_len))


def step(
    request_id: str, token_ids: list[int], start: int, page_ids: list[int] = (), sample: bool = True,
) -> worker_pb2.TaskEntry:
    return entry(request_id, list(token_ids), start, list(page_ids), sample)


class Driver:
    """Numbers tasks and keeps the executor at hand."""

    def __init__(self, rank: int = 0, runner: FakeRunner | None = None) -> None:
        self.runner = runner or FakeRunner(rank)
        self.executor = Executor(self.runner, Sampler(seed=0) if rank == 0 else None)
        self.task_id = 0

    def run(self, *entries: worker_pb2.TaskEntry, reset: bool = False, release: list[str] = ()) -> worker_pb2.TaskResult:
        self.task_id += 1
        result = self.executor.execute(task(self.task_id, list(entries), reset, list(release)))
        assert result.task_id == self.task_id
        return result

    def ok(self, *entries: worker_pb2.TaskEntry, **kwargs) -> list[int]:
        result = self.run(*entries, **kwargs)
        assert error_of(result) is None, result.error
        return [token.token_id for token in result.tokens]


def greedy_reference(prompt: list[int], num_tokens: int) -> list[int]:
    context, out = list(prompt), []
    for _ in range(num_tokens):
        token = int(fake_logits(context).argmax())
        out.append(token)
        context.append(token)
    return out
