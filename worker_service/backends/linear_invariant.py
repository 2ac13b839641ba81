"""Linear layers whose every row is computed the same way whatever the number of rows: the
product is taken over the rows padded to a multiple of `ROW_TILE` (`worker_service/row_tiles.py`
says why that suffices)."""

from __future__ import annotations

import torch

from worker_service.backends.base import PackedLinear
from worker_service.row_tiles import ROW_TILE, padded_rows


class RowTiledLinear(PackedLinear):
    """Another `PackedLinear` called on `x` padded to a multiple of `ROW_TILE` rows; the padding's
    results are dropped."""

    def __init__(self, inner: PackedLinear) -> None:
        self.inner = inner
        self.weight = inner.weight
        self.extra_bytes = inner.extra_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows % ROW_TILE == 0:
            return self.inner(x)
        return self.inner(padded_rows(x))[:rows]
