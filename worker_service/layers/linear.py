"""Tensor-parallel linear layers (no autograd: inference only).

Column-parallel splits output features (each rank computes its own slice of the outputs, no
communication); row-parallel splits input features and sums the partial products over the group.
A column-parallel layer may merge several checkpoint projections (q, k, v or gate, up) into one
matrix so that a rank runs one matmul instead of several.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_service.distributed import TPGroup, all_reduce_sum
from worker_service.layers.weights import WeightSlice, make_param


class ColumnParallelLinear(torch.nn.Module):
    """y = x @ W_local.T (+ b_local), where W_local stacks rows of one or more checkpoint matrices.

    `pieces` lists, in output order, `(checkpoint prefix, rows)`: rows `rows` of
    `<prefix>.weight` (and `<prefix>.bias` when `bias`).
    """

    def __init__(
        self,
        input_size: int,
        pieces: list[tuple[str, range]],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.output_sizes = [len(rows) for _, rows in pieces]
        output_size = sum(self.output_sizes)
        self.weight = make_param(
            (output_size, input_size),
            [WeightSlice(f"{prefix}.weight", rows) for prefix, rows in pieces],
            dtype, device,
        )
        self.bias = None
        if bias:
            self.bias = make_param(
                (output_size,),
                [WeightSlice(f"{prefix}.bias", rows) for prefix, rows in pieces],
                dtype, device,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(torch.nn.Module):
    """y = sum over ranks of x_local @ W[:, cols_local].T: the input arrives already split."""

    def __init__(
        self,
        prefix: str,
        input_cols: range,
        output_size: int,
        group: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.group = group
        self.weight = make_param(
            (output_size, len(input_cols)), [WeightSlice(f"{prefix}.weight", cols=input_cols)],
            dtype, device,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(F.linear(x, self.weight), self.group)
