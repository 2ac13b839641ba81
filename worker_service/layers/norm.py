"""RMSNorm: x / rms(x) * weight, computed by the backend (`Backend.rms_norm`, `add_rms_norm`)."""

from __future__ import annotations

import torch

from worker_service.backends.base import Backend
from worker_service.layers.weights import WeightSlice, make_param


class RMSNorm(torch.nn.Module):
    def __init__(self, name: str, size: int, eps: float, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_param((size,), [WeightSlice(name)], dtype, device)
        self.backend = backend

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm of `residual + x`, `residual + x`), the sum rounded to the dtype as a plain add
        would be. `residual` may be updated in place: it must be the model's own running sum."""
        return self.backend.add_rms_norm(x, residual, self.weight, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)
