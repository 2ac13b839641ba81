"""Decode attention on CUDA: every decode row read through its page table by one Triton kernel.

On a GPU the CPU path's approach (gather each row's pages into a padded buffer, then attend)
spends most of its memory traffic on the copy, and its shapes change every step. Here the step's
page tables become one padded int32 tensor `[rows, pages]` plus each row's length, and the kernel
(`triton_decode.py`) reads K/V straight from the pool's slots. Shared prefixes are not grouped:
on a GPU the rows sharing a prefix read the same pages from its L2 cache, and a kernel whose
launch depends only on shapes is what lets a decode step be replayed as a CUDA graph
(`worker_service/backends/cuda_graphs.py`).

The Triton backend (`worker_service/backends/triton_backend.py`) plans with it; where it is chosen
is `worker_service/backends/selection.py`.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from worker_service.attention import triton_decode


@dataclass(slots=True)
class GpuDecodePlan:
    """The decode rows of one step: `block_tables` int32 `[rows, pages]` (entries past a row's
    pages are ignored) and `context_lens` int32 `[rows]`, both on the pool's device."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    page_size: int

    @property
    def num_rows(self) -> int:
        return self.context_lens.shape[0]

    def attend(self, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor) -> torch.Tensor:
        """`q` `[rows, Hq, D]` against each row's context in the head-major pool -> `[rows, Hq, D]`."""
        return triton_decode.paged_decode(q, k_slots, v_slots, self.block_tables, self.context_lens,
                                          self.page_size)


def pages_of(length: int, page_size: int) -> int:
    """Pages holding positions 0 .. length - 1."""
    return -(-length // page_size)


def padded_tables(tables: list[list[int]], context_lens: list[int], page_size: int, fill: int) -> torch.Tensor:
    """Each row's pages that hold its `context_lens` positions, padded with `fill` to the widest
    row's: a CPU int32 tensor `[rows, width]`. Built in one flat int32 array (C-speed list
    copies) rather than `torch.tensor` of nested lists, which converts every int in Python: this
    runs for every decode step, over every page of every row."""
    used = [table[:pages_of(length, page_size)] for table, length in zip(tables, context_lens)]
    width = max(len(row) for row in used)
    flat = array("i")
    for row in used:
        flat.extend(row)
        if len(row) < width:
            flat.extend([fill] * (width - len(row)))
    return torch.frombuffer(flat, dtype=torch.int32).view(len(used), width)


def plan_gpu_decode(tables: list[list[int]], context_lens: list[int], page_size: int,
                    device: torch.device) -> GpuDecodePlan:
    """The plan for rows with page tables `tables` attending to `context_lens` positions each."""
    return GpuDecodePlan(
        block_tables=padded_tables(tables, context_lens, page_size, 0).to(device, non_blocking=True),
        context_lens=torch.tensor(context_lens, dtype=torch.int32).to(device, non_blocking=True),
        page_size=page_size,
    )
