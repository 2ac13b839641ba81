"""The contract between the request bookkeeping (executor) and the model runner.

The executor turns a validated DecodeTask into a list of `ForwardEntry`, one per task entry, in
task order, and every rank calls `ModelRunner.forward(entries)` with the same list. The runner
writes the entries' K/V into the slots their page tables name and returns, on rank 0 only, the
float32 logits of the last position of every entry with `sample=True` (in entry order).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ForwardEntry:
    """One request's tokens in one forward pass.

    `token_ids` sit at positions `start_position ... start_position + len(token_ids) - 1`.
    Positions before `start_position` are already in the KV pages. `page_table` is the request's
    whole page table (router-owned page ids) and covers every position up to the last new one:
    position p lives in slot `page_table[p // page_size] * page_size + p % page_size`.
    """

    token_ids: list[int]
    start_position: int
    page_table: list[int]
    sample: bool


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What a rank reports about itself (GetWorkerInfo)."""

    model_name: str
    dtype: str
    device: str
    page_size: int
    num_pages: int
    context_len: int
    vocab_size: int
    eos_token_ids: list[int]
    rank: int
    world_size: int
