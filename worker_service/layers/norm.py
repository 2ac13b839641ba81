"""RMSNorm: x / rms(x) * weight, computed in float32 whatever the model dtype.

With the compiled kernels (`worker_service.native`, set as `kernels` by the model runner) it is one
pass, and `add` (the residual add before the norm) too; PyTorch's ops otherwise (in float32 one
fused kernel, in half precision a chain of casts and ops). The fused decode layers
(`fused_layer.py`) call the same kernels, so both paths give the same bits in every dtype."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker_service.layers.weights import WeightSlice, make_param

if TYPE_CHECKING:
    from worker_service.native import NativeKernels


class RMSNorm(torch.nn.Module):
    def __init__(self, name: str, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = make_param((size,), [WeightSlice(name)], dtype, device)
        self.kernels: NativeKernels | None = None

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm of `residual + x`, `residual + x`), the sum rounded to the dtype as a plain add
        would be. `residual` may be updated in place: it must be the model's own running sum."""
        if self.kernels is not None and x.is_contiguous() and residual.is_contiguous():
            return self.kernels.add_rms_norm(residual, x, self.weight, self.eps), residual
        residual = residual + x
        return self(residual), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            # One fused kernel where no casts are needed.
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the weight, as the reference Llama/Qwen2 code does.
        return self.weight * x32.to(x.dtype)
