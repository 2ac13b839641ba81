"""What the compiled-kernels and the Triton backends share: the row-wise ops as one kernel each.

RMSNorm, the residual add with the norm after it, SwiGLU, and RoPE with the new K/V's write into
the pool are one pass each (`RowKernels`: `NativeKernels` on CPU, `TritonRowOps` on CUDA) where
PyTorch's ops are a chain of several kernels; each rounds where PyTorch's chain rounds, so the
results are the PyTorch backend's within the order of a float32 sum. Attention after the write
is each backend's own (`_attend_stored`).
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from worker_service.attention.windowed import windowed_attention
from worker_service.backends.base import (ATTENTION_SINKS, AttentionOptions, Rope, RowKernels, StepContext,
                                          only_sinks, options_for_step)
from worker_service.backends.grouped_experts import ExpertProducts
from worker_service.backends.linear_quant import QuantizedLinears
from worker_service.backends.torch_backend import TorchBackend
from worker_service.layers.rotary import RotaryEmbedding


class RowKernelBackend(TorchBackend):
    """A backend whose row-wise ops are `rows`' kernels (PyTorch's for what they do not take)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, rows: RowKernels,
                 quantized: QuantizedLinears | None = None, experts: ExpertProducts | None = None) -> None:
        super().__init__(device, dtype, quantized, experts)
        self.rows = rows

    def rope(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> Rope:
        """The whole tables: the kernel looks each token's position up itself."""
        return rotary.cos, rotary.sin

    def attention(self, qkv: torch.Tensor, num_q_heads: int, k_slots: torch.Tensor, v_slots: torch.Tensor,
                  step: StepContext, rope: Rope, options: AttentionOptions | None = None) -> torch.Tensor:
        # One pass rotates q and k in place and stores k and v.
        self.rows.rope_store(qkv, num_q_heads, step.positions, *rope, k_slots, v_slots, step.write_slots)
        options = options_for_step(options, step.batch)
        if options is not None and ATTENTION_SINKS in self.kernel_ops and only_sinks(options):
            return self._attend_stored(qkv, num_q_heads, k_slots, v_slots, step, options.sinks)
        if options is not None:  # no kernel has them: PyTorch's ops over the stored K/V
            return windowed_attention(qkv[:, :num_q_heads], k_slots, v_slots, step.batch, options)
        return self._attend_stored(qkv, num_q_heads, k_slots, v_slots, step)

    @abstractmethod
    def _attend_stored(self, qkv: torch.Tensor, num_q_heads: int, k_slots: torch.Tensor, v_slots: torch.Tensor,
                       step: StepContext, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the rotated `qkv`'s queries, the step's K/V already in the pool (with
        `sinks` only where the backend's kernel computes them: `ATTENTION_SINKS` in `kernel_ops`)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.rows.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if x.is_contiguous() and residual.is_contiguous():
            return self.rows.add_rms_norm(residual, x, weight, eps), residual
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.rows.silu_mul(gate_up)
