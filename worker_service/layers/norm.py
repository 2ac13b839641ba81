"""RMSNorm: x / rms(x) * weight, computed in float32 whatever the model dtype.

In half precision the compiled kernel (`worker_service.native`, set as `kernels` by the model
runner) does it in one pass; PyTorch's ops otherwise."""

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel where no casts are needed (the hot path on CPU in fp32).
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the weight, as the reference Llama/Qwen2 code does.
        return self.weight * x32.to(x.dtype)
