"""Hunyuan dense (`HunYuanDenseV1ForCausalLM`: Hunyuan-0.5B to -7B): Llama's layer with per-head q/k
RMSNorms applied after RoPE (`query_layernorm`, `key_layernorm`), and RoPE whose base is stretched by
a fixed NTK `alpha` (rope_type "dynamic" with `alpha`: base * alpha^(d / (d - 2)), the same at every
length, as transformers' class reads it).

The norms follow the rotation, which the backends fuse into their attention; so this family rotates
q and k itself (`apply_rotary`, the step's cos/sin looked up once), norms them, and gives the
backend unrotated tables (cos 1, sin 0: the rotation returns its input exactly). No fusable layer.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from worker_service.backends.base import Backend, StepContext
from worker_service.distributed import TPGroup
from worker_service.layers.qk_norm import HeadNorm
from worker_service.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters, served_context
from worker_service.models.layer_types import RotatesItself, SelfRotatedRope, unrotated_table
from worker_service.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, head_dim_of


class NormAfterRopeAttention(LlamaAttention):
    def __init__(self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
                 dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        super().__init__(config, layer, group, qkv_bias, dtype, device, backend)
        prefix, eps = f"model.layers.{layer}.self_attn", config.rms_norm_eps
        self.q_norm = HeadNorm(f"{prefix}.query_layernorm.weight", self.head_dim, eps, dtype, device, backend)
        self.k_norm = HeadNorm(f"{prefix}.key_layernorm.weight", self.head_dim, eps, dtype, device, backend)

    def attend(self, hidden: torch.Tensor, step: StepContext, rope: SelfRotatedRope) -> torch.Tensor:
        num_tokens, qk_heads = hidden.shape[0], self.num_q_heads + self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(num_tokens, qk_heads + self.num_kv_heads, self.head_dim)
        qkv[:, :qk_heads] = apply_rotary(qkv[:, :qk_heads], rope.cos, rope.sin)
        self.q_norm(qkv, 0, self.num_q_heads)
        self.k_norm(qkv, self.num_q_heads, self.num_kv_heads)
        k_slots, v_slots = step.pool.slots(self.layer)
        attended = self.backend.attention(qkv, self.num_q_heads, k_slots, v_slots, step, rope.backend, self.options)
        return attended.reshape(num_tokens, self.num_q_heads * self.head_dim)


class HunYuanDenseDecoderLayer(LlamaDecoderLayer):
    attention_class = NormAfterRopeAttention


def ntk_alpha_config(config: Any) -> Any:
    """`config`'s RoPE as plain RoPE over the base a fixed NTK `alpha` stretches (module doc)."""
    params = rope_parameters(config)
    if params["rope_type"] != "dynamic" or not params.get("alpha"):
        return config
    dim = head_dim_of(config)
    theta = params["rope_theta"] * params["alpha"] ** (dim / (dim - 2))
    return SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": theta},
                           max_position_embeddings=config.max_position_embeddings)


class HunYuanDenseV1ForCausalLM(RotatesItself, LlamaForCausalLM):
    """Checkpoint names follow Hugging Face's `HunYuanDenseV1ForCausalLM`."""

    fusable_layer = None
    layer_class = HunYuanDenseDecoderLayer

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        super().__init__(config, group, dtype, device, backend)
        self.rotary = RotaryEmbedding(ntk_alpha_config(config), head_dim_of(config), served_context(config), dtype,
                                      device)
        self.unrotated = unrotated_table(config, dtype, device)
