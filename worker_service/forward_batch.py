"""The contract between the request bookkeeping (executor) and the model runner.

The executor turns a validated DecodeTask (the wire message) into a list of `ForwardEntry`, one
per task entry, in task order, and every rank calls `ModelRunner.forward(entries)` with the same list. The runner
writes the entries' K/V into the slots their page tables name and returns, on rank 0 only, the
float32 logits of the last `num_logits` positions of every entry with `sample=True` (entry order,
positions in order within an entry: one row for a plain decode or prefill, one per verified
position for a speculative entry).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
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

    def slot(self, position: int, page_size: int) -> int:
        """The KV pool slot of `position` (see the class doc)."""
        return self.page_table[position // page_size] * page_size + position % page_size
