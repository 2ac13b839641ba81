"""RMSNorm of the query and key projections before RoPE, in the two forms families use.

`HeadNorm` (Qwen3, Qwen3-MoE) normalises each head's `head_dim` values with one weight shared by
every head, so a rank needs nothing from the others. `WidthNorm` (OLMo2, OLMoE) normalises the
whole projection, all heads of all ranks together: its statistic is a sum over the full width,
so under tensor parallelism each rank sums its own slice and the group adds the sums before any
rank divides. Both write their result back into the merged `qkv` `[T, Hq + 2 Hk, D]` in place.
"""

from __future__ import annotations

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup, all_reduce_sum
from worker_service.layers.weights import WeightSlice, make_param


class HeadNorm(torch.nn.Module):
    """RMSNorm over `head_dim` of `num_heads` heads from `first_head` of a merged `qkv`, by the backend."""

    def __init__(self, name: str, head_dim: int, eps: float, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = make_param((head_dim,), [WeightSlice(name)], dtype, device)

    def forward(self, qkv: torch.Tensor, first_head: int, num_heads: int) -> None:
        heads = qkv[:, first_head:first_head + num_heads]
        heads.copy_(self.backend.rms_norm(heads.reshape(-1, qkv.shape[-1]), self.weight, self.eps).view_as(heads))


class WidthNorm(torch.nn.Module):
    """RMSNorm over the full width `full_width` of a projection this rank holds `rows` of.

    Computed in float32 with PyTorch's ops (a collective sits between the sum and the scaling,
    which no backend's single-kernel norm has), rounding as the reference code does: normalised
    in float32, multiplied by the weight, then cast to the dtype. Each rank must hold a disjoint
    slice (replicated KV heads would count twice; the model refuses that split).
    """

    def __init__(self, name: str, rows: range, full_width: int, eps: float, group: TPGroup,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.group = group
        self.full_width = full_width
        self.weight = make_param((len(rows),), [WeightSlice(name, rows)], dtype, device)

    def forward(self, qkv: torch.Tensor, first_head: int, num_heads: int) -> None:
        heads = qkv[:, first_head:first_head + num_heads]
        x = heads.reshape(qkv.shape[0], -1).float()
        sums = all_reduce_sum(x.pow(2).sum(-1, keepdim=True), self.group)
        normed = x * torch.rsqrt(sums / self.full_width + self.eps)
        heads.copy_((self.weight.float() * normed).to(qkv.dtype).view_as(heads))
