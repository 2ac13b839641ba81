"""Linear layers whose every row is computed the same way whatever the number of rows: the
product is taken over the rows padded to a multiple of a tile (`worker_service/row_tiles.py` says
why that suffices): `ROW_TILE` in general, `PACKED_ROW_TILE` for oneDNN's packed float32 weights,
whose kernel gives a row the same bits in every product of two rows or more (only a single row
takes another path), so a decode step of one row multiplies two instead of eight."""

from __future__ import annotations

import torch

from worker_service.backends.base import PackedLinear
from worker_service.backends.linear_torch import TorchLinear
from worker_service.row_tiles import ROW_TILE, padded_rows


PACKED_ROW_TILE = 2


def row_tile(linear: PackedLinear) -> int:
    """The rows `linear`'s products are padded to a multiple of (module doc)."""
    packed_float32 = isinstance(linear, TorchLinear) and linear.packed and linear.weight.dtype == torch.float32
    return PACKED_ROW_TILE if packed_float32 else ROW_TILE


class RowTiledLinear(PackedLinear):
    """Another `PackedLinear` called on `x` padded to a multiple of `row_tile(inner)` rows; the
    padding's results are dropped."""

    def __init__(self, inner: PackedLinear) -> None:
        self.inner = inner
        self.tile = row_tile(inner)
        self.weight = inner.weight
        self.extra_bytes = inner.extra_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows % self.tile == 0:
            return self.inner(x)
        return self.inner(padded_rows(x, self.tile))[:rows]
