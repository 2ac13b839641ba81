"""Where each parameter's values come from in the checkpoint.

A layer attaches to every parameter it owns a list of `WeightSlice`s; the loader reads exactly
those slices (and nothing else) and concatenates them along dim 0. That keeps sharding the
layer's own business: a merged q/k/v projection lists three slices, a row-parallel projection
lists one column range. A family that stores a layer's experts in one 3-D tensor (GPT-OSS's
`[experts, in, out]`) names an expert and reads its matrix transposed; a range with a step reads
every step-th row (GPT-OSS's gate and up features, interleaved).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class WeightSlice:
    """Rows and columns (None = all) of one checkpoint tensor, as the parameter lays them out
    (`[out, in]` for a linear weight). `expert`: the tensor is 3-D and this is the matrix at that
    index of its first dimension. `transposed`: the checkpoint holds the matrix as `[in, out]`, so
    `rows` select its columns and `cols` its rows, and the slice is read transposed."""

    name: str
    rows: range | None = None
    cols: range | None = None
    expert: int | None = None
    transposed: bool = False


def make_param(
    shape: tuple[int, ...], slices: list[WeightSlice], dtype: torch.dtype, device: torch.device
) -> torch.nn.Parameter:
    """An uninitialised, frozen parameter that the loader fills from `slices`."""
    param = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_slices = slices  # read by worker_service.loader
    return param
