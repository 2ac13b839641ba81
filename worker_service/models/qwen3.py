"""Qwen3: Llama's layer with an RMSNorm over each query and key head before RoPE (`HeadNorm`).

The per-head norm sits between the projection and the rotation, which the compiled whole-layer
Llama path does not have: the model declares no fusable layer and runs its layers module by module.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.layers.qk_norm import HeadNorm
from worker_service.models.config_checks import BY_LAYER_TYPE
from worker_service.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, head_dim_of


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
                 dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        super().__init__(config, layer, group, qkv_bias, dtype, device, backend)
        prefix = f"model.layers.{layer}.self_attn"
        d, eps = head_dim_of(config), config.rms_norm_eps
        self.q_norm = HeadNorm(f"{prefix}.q_norm.weight", d, eps, dtype, device, backend)
        self.k_norm = HeadNorm(f"{prefix}.k_norm.weight", d, eps, dtype, device, backend)

    def prepare_qk(self, qkv: torch.Tensor) -> None:
        self.q_norm(qkv, 0, self.num_q_heads)
        self.k_norm(qkv, self.num_q_heads, self.num_kv_heads)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Checkpoint names follow Hugging Face's `Qwen3ForCausalLM` (without `attention_bias`, whose
    o_proj bias the row-parallel projection does not have: refused by Llama's check)."""

    fusable_layer = None
    layer_class = Qwen3DecoderLayer
    window_rule = BY_LAYER_TYPE
