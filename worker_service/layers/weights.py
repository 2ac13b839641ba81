"""Where each parameter's values come from in the checkpoint.

A layer attaches to every parameter it owns a list of `WeightSlice`s; the loader reads exactly
those slices (and nothing else) and concatenates them along dim 0. That keeps sharding the
layer's own business: a merged q/k/v projection lists three slices, a row-parallel projection
lists one column range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class WeightSlice:
    """Rows and columns (None = all) of one checkpoint tensor."""

    name: str
    rows: range | None = None
    cols: range | None = None


def make_param(
    shape: tuple[int, ...], slices: list[WeightSlice], dtype: torch.dtype, device: torch.device
) -> torch.nn.Parameter:
    """An uninitialised, frozen parameter that the loader fills from `slices`."""
    param = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_slices = slices  # read by worker_service.loader
    return param
