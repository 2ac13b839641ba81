"""GLM-4.5 MoE (`Glm4MoeForCausalLM`: GLM-4.5, GLM-4.5-Air, GLM-4.6): Llama's layer with biases on
q/k/v and RoPE over the first `partial_rotary_factor` (0.5) of each head in halves (Phi-3's
partial rotation: q and k rows reordered at load), and DeepSeek-V3's mixture of experts
(`deepseek.DeepseekV3MoE`: sigmoid routing with a correction bias over groups, renormalised and
scaled, plus shared experts) after `first_k_dense_replace` dense layers.

With `use_qk_norm`, Qwen3's per-head RMSNorm on q and k before RoPE, its weights put in the order
the load gives the rows (the mean of squares does not depend on it). Refused by name:
`attention_bias=False`. Its multi-token-prediction layer is not read. No fusable layer.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.models.deepseek import DeepseekV3MoE, dense_until
from worker_service.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from worker_service.models.moe import RoutesExperts
from worker_service.models.qwen3 import Qwen3Attention
from worker_service.unsupported import UnsupportedModel


class ReorderedHeadNormAttention(Qwen3Attention):
    """Qwen3's attention whose q/k norms' weights follow the rows' order at load (module doc)."""

    norms_follow_order = True

    def reorder_qk(self, order: torch.Tensor) -> None:
        super().reorder_qk(order)
        for norm in (self.q_norm, self.k_norm):
            norm.weight.data = norm.weight.data.index_select(0, order.to(norm.weight.device))


def glm4_moe_attention(config: Any, layer: int, group: TPGroup, qkv_bias: bool, dtype: torch.dtype,
                       device: torch.device, backend: Backend) -> LlamaAttention:
    attention_class = ReorderedHeadNormAttention if getattr(config, "use_qk_norm", False) else LlamaAttention
    return attention_class(config, layer, group, qkv_bias, dtype, device, backend)


class Glm4MoeDecoderLayer(LlamaDecoderLayer):
    attention_class = staticmethod(glm4_moe_attention)
    mlp_class = dense_until(DeepseekV3MoE)


class Glm4MoeForCausalLM(RoutesExperts, LlamaForCausalLM):
    """Checkpoint names follow Hugging Face's `Glm4MoeForCausalLM` (experts one by one)."""

    fusable_layer = None
    qkv_bias = True
    partial_rotary = True
    layer_class = Glm4MoeDecoderLayer

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        if not getattr(config, "attention_bias", True):
            raise UnsupportedModel("Glm4MoeForCausalLM with attention_bias=False is not supported")
        super().__init__(config, group, dtype, device, backend)
