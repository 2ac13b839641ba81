"""Gemma's RMSNorm: x / rms(x) * (1 + weight), all in float32 and cast back once at the end, as
the reference Gemma code rounds (Llama's norm casts before the weight; the backends' norms do).
Computed with PyTorch's ops on every backend."""

from __future__ import annotations

import torch

from worker_service.layers.weights import WeightSlice, make_param


class GemmaRMSNorm(torch.nn.Module):
    def __init__(self, name: str, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_param((size,), [WeightSlice(name)], dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Over the last dim of `x` (any leading shape)."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
