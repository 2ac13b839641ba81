"""The PyTorch backend in its batch- and cache-invariant form (`--deterministic`).

Every result a row gets is computed in an order fixed by the row alone: linear layers (the LM
head included) multiply row-padded products (`linear_invariant.py`); attention reduces each query
over fixed chunks of whole pages merged by log-sum-exp in page order
(`worker_service/attention/invariant.py`), for decode rows and prefill chunks alike, with
`AttentionOptions` too. RMSNorm, SwiGLU, RoPE and the sampler are row-wise already (the sampler
draws from each request's own generator). So at a given TP size a request gets the same tokens
and logprobs whatever shares its step, whether its prefix came from the cache or was computed
with it, and after a retraction; docs/determinism.md says what is and is not promised.
"""

from __future__ import annotations

import torch

from worker_service.attention.decode_plan import length_buckets
from worker_service.attention.invariant import NO_LIMITS, InvariantBatch, group_of
from worker_service.backends.base import AttentionOptions, PackedLinear, Rope, StepBatch, StepContext
from worker_service.backends.linear_invariant import RowTiledLinear
from worker_service.backends.torch_backend import TorchBackend
from worker_service.kv_pool import KVPool
from worker_service.quant.format import QuantizedWeight


class InvariantTorchBackend(TorchBackend):
    """`TorchBackend` with every reduction in a batch-independent order (module doc)."""

    def plan(self, batch: StepBatch, pool: KVPool) -> StepContext:
        groups = []
        lengths = batch.decode_context_lens
        for rows in length_buckets(lengths):  # rows of similar length: little padding per group
            groups.append(group_of([([row], [lengths[row] - 1], batch.decode_tables[row]) for row in rows],
                                   batch.page_size, self.device))
        for chunk in batch.prefills:
            tokens = range(chunk.token_start, chunk.token_start + chunk.num_tokens)
            positions = range(chunk.start_position, chunk.start_position + chunk.num_tokens)
            groups.append(group_of([(list(tokens), list(positions), chunk.page_ids)], batch.page_size, self.device))
        attention = InvariantBatch(batch.page_size, batch.write_slots, groups, self.space)
        return StepContext(batch.positions, batch.write_slots, attention, pool, batch)

    def pack(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None, *,
             float32_out: bool = False) -> PackedLinear:
        return RowTiledLinear(super().pack(weight, bias, float32_out=float32_out))

    def attention(self, qkv: torch.Tensor, num_q_heads: int, k_slots: torch.Tensor, v_slots: torch.Tensor,
                  step: StepContext, rope: Rope, options: AttentionOptions | None = None) -> torch.Tensor:
        q, k, v = self.rotated(qkv, num_q_heads, k_slots.shape[0], rope)
        limits = NO_LIMITS if options is None else (options.window, options.softcap, options.scale, options.sinks)
        return step.attention.attend(q, k, v, k_slots, v_slots, limits)
