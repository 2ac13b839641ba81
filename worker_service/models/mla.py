"""Multi-head latent attention (MLA: DeepSeek-V2, DeepSeek-V3 and their descendants), served on the
paged attention every backend already has, with its latent cached rather than its keys.

Each token's keys and values are made from one latent row: `c` (`kv_lora_rank`, RMS-normed) and
a rotated key part `k_pe` (`qk_rope_head_dim`) shared by every head. Head h's key is
[W_UK[h] c, k_pe] and its value W_UV[h] c (W_UK and W_UV are `kv_b_proj`'s rows). Since

    q_h . k_h = (W_UK[h]^T q_nope_h) . c + q_pe_h . k_pe    and    sum_j a_j W_UV[h] c_j = W_UV[h] sum_j a_j c_j,

attention is one multi-query attention over the latent: every head's query is
[W_UK[h]^T q_nope_h, q_pe_h] and the one KV head's key and value are both [c, k_pe]
(`kv_lora_rank + qk_rope_head_dim` dims, 576 in every released DeepSeek). The pool holds that row
per token (as key and as value), the backend attends as for any model with one KV head, and the
first `kv_lora_rank` dims of each head's output, times W_UV[h], are the head's output. A
DeepSeek-V2-Lite token takes 31 KB of cache in bfloat16 over its 27 layers (the pool holds the row
once: `CausalLM.values_are_keys`), where its expanded keys and values would take 276 KB.

- **RoPE** turns `q_pe` and `k_pe` only: rotated here (pairs (2i, 2i + 1) where the checkpoint's
  are interleaved, as DeepSeek's are: those rows reordered at load, as GLM's), and the backend is
  given unrotated tables (cos 1, sin 0: its rotation returns its input exactly).
- **The softmax scale** (1/sqrt(`qk_nope_head_dim + qk_rope_head_dim`), times YaRN's mscale
  squared where `mscale_all_dim` says so) is folded into W_UK and the `q_pe` rows at load, so
  that the backend's own scale over the latent's dims gives it: no attention with options.
- **Tensor parallel**: query heads are split (the q projection's rows, W_UK, W_UV and o_proj's
  columns per head); the latent is every rank's whole (one KV head, replicated), as `kv_a_proj`.

The per-head products are batched matrix products over rows padded to `ROW_TILE`, so a row's
bits do not depend on the step's other rows (`--deterministic`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from worker_service.backends.base import Backend, StepContext
from worker_service.distributed import TPGroup
from worker_service.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker_service.layers.norm import RMSNorm
from worker_service.layers.rotary import apply_rotary, rope_parameters, yarn_temperature
from worker_service.layers.sharding import shard_heads
from worker_service.layers.weights import WeightSlice, make_param
from worker_service.models.layer_types import SelfRotatedRope
from worker_service.row_tiles import padded_rows
from worker_service.unsupported import UnsupportedModel

# transformers' DeepSeek classes give the latent's norms (q_a_layernorm, kv_a_layernorm) their
# RMSNorm's default epsilon, whatever `rms_norm_eps` says.
LATENT_NORM_EPS = 1e-6


def latent_width(config: Any) -> int:
    """The dims of one token's cached row: the latent and the shared rotated key."""
    return config.kv_lora_rank + config.qk_rope_head_dim


def softmax_scale(config: Any) -> float:
    """transformers' DeepSeek scale: 1/sqrt(qk head dim), times mscale(factor, mscale_all_dim)^2
    for a scaled RoPE whose `mscale_all_dim` is set."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        scale *= yarn_temperature(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


def head_products(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each head's rows times its own matrix: `x` `[T, H, K]`, `weights` `[H, K, N]` -> `[T, H, N]`,
    over rows padded to `ROW_TILE` (module doc)."""
    rows = x.shape[0]
    return torch.matmul(padded_rows(x.transpose(0, 1)), weights)[:, :rows].transpose(0, 1)


class MlaAttention(torch.nn.Module):
    def __init__(self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
                 dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        super().__init__()
        if getattr(config, "attention_bias", False):
            raise UnsupportedModel("multi-head latent attention with attention_bias=True is not supported")
        self.backend = backend
        self.layer = layer
        self.nope, self.rope_dims = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dims, self.latent = config.v_head_dim, config.kv_lora_rank
        heads = shard_heads(config.num_attention_heads, 1, group.world_size, group.rank).q_heads
        self.num_q_heads = len(heads)
        prefix, hidden, qk = f"model.layers.{layer}.self_attn", config.hidden_size, self.nope + self.rope_dims
        q_rows = range(heads.start * qk, heads.stop * qk)
        q_lora_rank = getattr(config, "q_lora_rank", None)
        if q_lora_rank is None:
            self.q_a = self.q_a_norm = None
            self.q_proj = ColumnParallelLinear(hidden, [(f"{prefix}.q_proj", q_rows)], False, dtype, device)
        else:  # DeepSeek-V2 and V3: the query through its own low-rank latent
            self.q_a = ColumnParallelLinear(hidden, [(f"{prefix}.q_a_proj", range(q_lora_rank))], False, dtype, device)
            self.q_a_norm = RMSNorm(f"{prefix}.q_a_layernorm.weight", q_lora_rank, LATENT_NORM_EPS, dtype, device,
                                    backend)
            self.q_proj = ColumnParallelLinear(q_lora_rank, [(f"{prefix}.q_b_proj", q_rows)], False, dtype, device)
        self.kv_a = ColumnParallelLinear(hidden, [(f"{prefix}.kv_a_proj_with_mqa", range(latent_width(config)))],
                                         False, dtype, device)
        self.kv_a_norm = RMSNorm(f"{prefix}.kv_a_layernorm.weight", self.latent, LATENT_NORM_EPS, dtype, device,
                                 backend)
        per_head = self.nope + self.v_dims
        kv_b_rows = range(heads.start * per_head, heads.stop * per_head)
        # kv_b_proj's rows of this rank's heads; absorbed into `w_uk` and `w_uv` at load.
        self.kv_b = make_param((len(kv_b_rows), self.latent), [WeightSlice(f"{prefix}.kv_b_proj.weight", kv_b_rows)],
                               dtype, device)
        self.o_proj = RowParallelLinear(f"{prefix}.o_proj", range(heads.start * self.v_dims, heads.stop * self.v_dims),
                                        hidden, group, dtype, device)
        self.scale = softmax_scale(config) * math.sqrt(latent_width(config))  # over the backend's 1/sqrt(width)
        self.w_uk: torch.Tensor | None = None  # [H, nope, latent], scaled
        self.w_uv: torch.Tensor | None = None  # [H, latent, v]

    def reorder_qk(self, order: torch.Tensor) -> None:
        """Put the rotated dims of each head's q rows and of the shared k_pe rows in `order`
        (`RotaryEmbedding.permutation`): q_pe . k_pe sums the same products in another order."""
        qk = self.nope + self.rope_dims
        q_rows = torch.cat([torch.cat([torch.arange(h * qk, h * qk + self.nope), h * qk + self.nope + order])
                            for h in range(self.num_q_heads)])
        self._take_rows(self.q_proj, q_rows)
        self._take_rows(self.kv_a, torch.cat([torch.arange(self.latent), self.latent + order]))

    @staticmethod
    def _take_rows(linear: ColumnParallelLinear, rows: torch.Tensor) -> None:
        if linear.checkpoint_quantized is not None:
            raise UnsupportedModel("multi-head latent attention over quantized checkpoint rows is not supported")
        linear.weight.data = linear.weight.data.index_select(0, rows.to(linear.weight.device))

    def absorb(self) -> None:
        """Once loaded (and reordered): W_UK and W_UV from kv_b_proj, the softmax scale folded into
        W_UK and the q_pe rows (module doc)."""
        if self.q_proj.checkpoint_quantized is not None:
            raise UnsupportedModel("multi-head latent attention over quantized checkpoint rows is not supported")
        kv_b = self.kv_b.detach().float().view(self.num_q_heads, self.nope + self.v_dims, self.latent)
        dtype = self.kv_b.dtype
        self.w_uk = (kv_b[:, :self.nope] * self.scale).to(dtype).contiguous()
        self.w_uv = kv_b[:, self.nope:].transpose(1, 2).to(dtype).contiguous()
        self.kv_b = None
        qk = self.nope + self.rope_dims
        weight = self.q_proj.weight.data.view(self.num_q_heads, qk, -1)
        weight[:, self.nope:] = (weight[:, self.nope:].float() * self.scale).to(weight.dtype)

    def forward(self, hidden: torch.Tensor, step: StepContext, rope: SelfRotatedRope) -> torch.Tensor:
        num_tokens, heads = hidden.shape[0], self.num_q_heads
        q_in = hidden if self.q_a is None else self.q_a_norm(self.q_a(hidden))
        q = self.q_proj(q_in).view(num_tokens, heads, self.nope + self.rope_dims)
        latent = self.kv_a(hidden)
        c = self.kv_a_norm(latent[:, :self.latent].contiguous())
        k_pe = apply_rotary(latent[:, None, self.latent:], rope.cos, rope.sin)
        q_pe = apply_rotary(q[:, :, self.nope:], rope.cos, rope.sin)
        queries = torch.cat([head_products(q[:, :, :self.nope], self.w_uk), q_pe], dim=-1)
        kv = torch.cat([c[:, None], k_pe], dim=-1)
        qkv = torch.cat([queries, kv, kv], dim=1)  # the latent row is the one KV head's key and value
        k_slots, v_slots = step.pool.slots(self.layer)
        attended = self.backend.attention(qkv, heads, k_slots, v_slots, step, rope.backend)
        out = head_products(attended[:, :, :self.latent], self.w_uv)
        return self.o_proj(out.reshape(num_tokens, heads * self.v_dims))
