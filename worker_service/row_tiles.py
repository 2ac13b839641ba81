"""Row padding for products whose per-row result must not depend on how many rows they have.

CPU matrix products pick their blocking from the shape: oneDNN's packed float32 kernel multiplies
a single row (a matrix-vector product) in another order than two or more, and MKL's float32 GEMM
(what plain `F.linear` and `matmul` call) treats the rows past the last multiple of its register
tile apart from the others. A row padded into a product of a multiple of `ROW_TILE` rows gets the
same bits in every product of such a height, whatever the other rows hold
(`tests/worker/test_invariance_kernels.py` checks every height from 1 to 300 at model shapes).
"""

from __future__ import annotations

import torch

ROW_TILE = 8


def padded_rows(x: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """`x` `[..., M, K]` with zero rows appended up to a multiple of `tile` rows."""
    extra = -x.shape[-2] % tile
    if not extra:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:-2], extra, x.shape[-1])], dim=-2)
