"""Mixtral: Llama's attention with a sparse mixture-of-experts MLP (`moe.SparseMoE`:
`num_local_experts` experts `w1` (gate), `w3` (up), `w2` (down) under `block_sparse_moe`, top
`num_experts_per_tok`, always renormalised). A window shorter than the context applies to every
layer, as for Mistral. No fusable layer.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.models.config_checks import EVERY_LAYER
from worker_service.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from worker_service.models.moe import ExpertLayout, Routing, RoutesExperts, SparseMoE
from worker_service.unsupported import UnsupportedModel

LAYOUT = ExpertLayout("block_sparse_moe", "w1", "w3", "w2")


def mixtral_moe(config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                backend: Backend) -> torch.nn.Module:
    if config.hidden_act != "silu":
        raise UnsupportedModel(f"unsupported activation {config.hidden_act!r} (only silu)")
    routing = Routing(config.num_local_experts, config.num_experts_per_tok, normalize=True)
    return SparseMoE(layer, config.hidden_size, config.intermediate_size, routing, LAYOUT, group, dtype, device,
                     backend)


class MixtralDecoderLayer(LlamaDecoderLayer):
    mlp_class = staticmethod(mixtral_moe)


class MixtralForCausalLM(RoutesExperts, LlamaForCausalLM):
    fusable_layer = None
    layer_class = MixtralDecoderLayer
    window_rule = EVERY_LAYER
