"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a sparse mixture-of-experts MLP
(`moe.SparseMoE`: `num_experts` experts of `moe_intermediate_size`, top `num_experts_per_tok`,
renormalised when `norm_topk_prob`). Layers listed in `mlp_only_layers`, or off the
`decoder_sparse_step` stride, keep a dense MLP of `intermediate_size`. No fusable layer.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.models.config_checks import EVERY_LAYER
from worker_service.models.llama import LlamaDecoderLayer, LlamaMLP
from worker_service.models.moe import ExpertLayout, Routing, RoutesExperts, SparseMoE
from worker_service.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM

LAYOUT = ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj")


def is_sparse(config: Any, layer: int) -> bool:
    return (layer not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (layer + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


def qwen3_moe_mlp(config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                  backend: Backend) -> torch.nn.Module:
    if not is_sparse(config, layer):
        return LlamaMLP(config, layer, group, dtype, device, backend)
    routing = Routing(config.num_experts, config.num_experts_per_tok, bool(config.norm_topk_prob))
    return SparseMoE(layer, config.hidden_size, config.moe_intermediate_size, routing, LAYOUT, group, dtype,
                     device, backend)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention
    mlp_class = staticmethod(qwen3_moe_mlp)


class Qwen3MoeForCausalLM(RoutesExperts, Qwen3ForCausalLM):
    layer_class = Qwen3MoeDecoderLayer
    window_rule = EVERY_LAYER  # its class has no layer types
