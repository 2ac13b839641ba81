"""The contract between the request bookkeeping (executor) and the model runner.

The executor turns a validated DecodeTask (the wire message) into a list of `ForwardEntry`, one
per task entry, in task order, and every rank calls `ModelRunner.forward(entries)` with the same list. The runner
writes the entries' K/V into the slots their page tables name and returns, on rank 0 only, the
float32 logits of the last `num_logits` positions of every entry with `sample=True` (entry order,
positions in order within an entry: one row for a plain decode or prefill, one per verified
position for a speculative entry). `ModelRunner.forward_step` also returns, per entry with a
pooling mode, what the embedding needs of this chunk (see `StepOutput`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.v1 import worker_pb2


# Not frozen, as SampleRow (sampling/rows.py): one for every row of every step.
@dataclass(slots=True)
class ForwardEntry:
    """One request's tokens in one forward pass.

    `token_ids` sit at positions `start_position ... start_position + len(token_ids) - 1`.
    Positions before `start_position` are already in the KV pages. `page_table` is the request's
    whole page table (router-owned page ids) and covers every position up to the last new one:
    position p lives in slot `page_table[p // page_size] * page_size + p % page_size`. It is the
    request state's own list (not a copy): read it during `forward`, do not keep or change it.
    """

    token_ids: list[int]
    start_position: int
    page_table: list[int]
    sample: bool
    # With `sample`: logits of this many last positions (1 + the entry's drafts).
    num_logits: int = 1
    # An embedding request's `worker_pb2.PoolingMode` (NONE: a generation request). Such an
    # entry never samples; `last` marks the chunk that completes its prompt (False otherwise).
    pooling: int = worker_pb2.POOLING_MODE_NONE
    last: bool = False

    def slot(self, position: int, page_size: int) -> int:
        """The KV pool slot of `position` (see the class doc)."""
        return self.page_table[position // page_size] * page_size + position % page_size


@dataclass(slots=True)
class StepOutput:
    """What rank 0 gets of a step (other ranks: None and no pooled rows).

    `pooled[i]` belongs to entry i when it has a pooling mode, float32 `[hidden]`: for MEAN the
    sum of the final hidden states over the chunk's positions; for LAST the final hidden state
    of the prompt's last position when the entry is `last`, else None. None for other entries.
    """

    logits: torch.Tensor | None
    pooled: list[torch.Tensor | None]
