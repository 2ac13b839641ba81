"""The PyTorch backend: every operation in PyTorch's own ops, on any device and dtype.

It is the reference the other backends are held to (and what runs where neither the compiled
kernels nor Triton can). Attention gathers each sequence's pages and attends with PyTorch's
kernels (`worker_service/attention/paged.py`: shared prefixes once per group for decode rows,
SDPA for prefill chunks; attention sinks from the same attention's log-sum-exps, `with_sinks`);
RMSNorm rounds where the reference Llama code rounds; linear layers use oneDNN's packed weights
on CPU (`linear_torch.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_service.attention import (AttentionBatch, CascadeDecode, GatherSpace, PrefillSpan, additive_mask,
                                      paged_attention, plan_decode)
from worker_service.attention.paged import DecodeAttention, paged_attention_with_lse
from worker_service.attention.windowed import windowed_attention
from worker_service.backends.base import (AttentionOptions, Backend, ExpertExtras, PackedExperts, PackedLinear,
                                          PrefillChunk, Rope, StepBatch, StepContext, only_sinks, options_for_step)
from worker_service.backends.grouped_experts import ExpertProducts
from worker_service.backends.linear_quant import QuantizedLinears
from worker_service.backends.linear_torch import TorchLinear
from worker_service.kv_pool import KVPool
from worker_service.layers.rotary import RotaryEmbedding, apply_rotary
from worker_service.quant.format import QuantizedWeight


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention `out` `[T, Hq, D]` (scores' log-sum-exp `lse` `[T, Hq]`) with each head's sink
    joining its softmax's denominator: every weight scales by e^lse / (e^lse + e^sink), that is
    by sigmoid(lse - sink)."""
    scale = torch.sigmoid(lse - sinks.float()).unsqueeze(-1)
    return (out.float() * scale).to(out.dtype)


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, device: torch.device, dtype: torch.dtype, quantized: QuantizedLinears | None = None,
                 experts: ExpertProducts | None = None) -> None:
        super().__init__(device, dtype)
        # How quantized weights are multiplied (`linear_quant.py`): dequantizing unless told.
        self.quantized = quantized or QuantizedLinears()
        # How MoE experts are computed (`grouped_experts.py`): per expert unless told.
        self.experts = experts or ExpertProducts()
        self.space = GatherSpace()  # page gathers' buffers, reused by every layer and step

    def plan(self, batch: StepBatch, pool: KVPool) -> StepContext:
        decode = self._plan_decode(batch) if batch.decode_tables else None
        attention = AttentionBatch(batch.page_size, batch.write_slots, decode,
                                   [self._span(chunk, batch.page_size) for chunk in batch.prefills], self.space)
        return StepContext(batch.positions, batch.write_slots, attention, pool, batch)

    def _plan_decode(self, batch: StepBatch) -> DecodeAttention:
        plan = plan_decode(batch.decode_tables, batch.decode_context_lens, batch.page_size, self.device)
        return CascadeDecode(plan, batch.page_size, self.space)

    def _span(self, chunk: PrefillChunk, page_size: int) -> PrefillSpan:
        """A prefill chunk for `paged_attention`: from position 0 it needs nothing from the pool;
        later, its context's pages and a causal mask shifted by its start."""
        token_stop = chunk.token_start + chunk.num_tokens
        if chunk.start_position == 0:
            return PrefillSpan(chunk.token_start, token_stop, None, None)
        start, end = chunk.start_position, chunk.start_position + chunk.num_tokens
        key_positions = torch.arange(len(chunk.pages) * page_size).unsqueeze(0)
        allowed = key_positions <= torch.arange(start, end).unsqueeze(1)
        return PrefillSpan(chunk.token_start, token_stop, chunk.pages.to(self.device),
                           additive_mask(allowed.to(self.device), self.dtype))

    def pack(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None, *,
             float32_out: bool = False) -> PackedLinear:
        if isinstance(weight, QuantizedWeight):
            return self.quantized.pack(weight, bias, float32_out)
        return TorchLinear(weight, bias, float32_out)

    def pack_experts(self, gate_up: list[torch.Tensor], down: list[torch.Tensor],
                     extras: ExpertExtras | None = None) -> PackedExperts | None:
        return self.experts.pack(gate_up, down, extras)

    def rope(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> Rope:
        """The tables' rows at the step's positions, `[T, 1, head_dim]` (looked up once per step)."""
        return rotary.lookup(positions)

    @staticmethod
    def rotated(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v) of the merged projections, q and k rotated."""
        # q and k sit side by side in the merged output: rotate both with one call.
        qk = apply_rotary(qkv[:, : num_q_heads + num_kv_heads], *rope)
        q, k = qk.split([num_q_heads, num_kv_heads], dim=1)
        return q, k, qkv[:, num_q_heads + num_kv_heads:]

    def attention(self, qkv: torch.Tensor, num_q_heads: int, k_slots: torch.Tensor, v_slots: torch.Tensor,
                  step: StepContext, rope: Rope, options: AttentionOptions | None = None) -> torch.Tensor:
        q, k, v = self.rotated(qkv, num_q_heads, k_slots.shape[0], rope)
        options = options_for_step(options, step.batch)
        if options is None:
            return paged_attention(q, k, v, k_slots, v_slots, step.attention)
        k_slots.index_copy_(1, step.write_slots, k.transpose(0, 1))
        v_slots.index_copy_(1, step.write_slots, v.transpose(0, 1))
        if only_sinks(options):
            return with_sinks(*paged_attention_with_lse(q, k, v, k_slots, v_slots, step.attention), options.sinks)
        return windowed_attention(q, k_slots, v_slots, step.batch, options)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """In float32 whatever the dtype; cast back before the weight, as the reference Llama and
        Qwen2 code does."""
        if x.dtype == torch.float32:
            # One fused kernel where no casts are needed.
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The one implementation every backend uses (none has a kernel for it)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
