"""RMSNorm: x / rms(x) * weight, computed in float32 whatever the model dtype."""

from __future__ import annotations

import torch

from worker_service.layers.weights import WeightSlice, make_param


class RMSNorm(torch.nn.Module):
    def __init__(self, name: str, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = make_param((size,), [WeightSlice(name)], dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel where no casts are needed (the hot path on CPU in fp32).
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the weight, as the reference Llama/Qwen2 code does.
        return self.weight * x32.to(x.dtype)
