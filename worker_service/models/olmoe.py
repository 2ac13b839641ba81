"""OLMoE: Llama's pre-norm layer with OLMo's full-width q/k norms (`olmo2.WidthNormAttention`,
which refuses a TP split that replicates KV heads) and a sparse mixture-of-experts MLP
(`moe.SparseMoE`: `num_experts` experts, top `num_experts_per_tok`, renormalised only when
`norm_topk_prob`). Clipping of q/k/v (`clip_qkv`) is refused. No fusable layer.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from worker_service.models.moe import ExpertLayout, Routing, RoutesExperts, SparseMoE
from worker_service.models.olmo2 import WidthNormAttention
from worker_service.unsupported import UnsupportedModel

LAYOUT = ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj")


def olmoe_moe(config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
              backend: Backend) -> torch.nn.Module:
    routing = Routing(config.num_experts, config.num_experts_per_tok, bool(config.norm_topk_prob))
    return SparseMoE(layer, config.hidden_size, config.intermediate_size, routing, LAYOUT, group, dtype, device,
                     backend)


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_class = WidthNormAttention
    mlp_class = staticmethod(olmoe_moe)


class OlmoeForCausalLM(RoutesExperts, LlamaForCausalLM):
    fusable_layer = None
    layer_class = OlmoeDecoderLayer

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        if getattr(config, "clip_qkv", None) is not None:
            raise UnsupportedModel(f"OLMoE with clip_qkv={config.clip_qkv} is not supported")
        super().__init__(config, group, dtype, device, backend)
