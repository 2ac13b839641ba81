"""ERNIE 4.5 MoE (`Ernie4_5_MoeForCausalLM`: ERNIE-4.5-21B-A3B, its Thinking variant,
ERNIE-4.5-300B-A47B's text): ERNIE 4.5's attention (RoPE in interleaved pairs over whole heads,
`ernie4_5.py`) with a sparse mixture of SwiGLU experts plus shared ones in the layers
`moe_layer_interval`, `moe_layer_start_index` and `moe_layer_end_index` select; the others dense.

Routing, in float32 from a float32 router (transformers keeps `mlp.gate` so): softmax over every
expert; the choice adds `moe_statics.e_score_correction_bias`; the chosen probabilities divided
by their sum, clamped below at `moe_norm_min`. The shared experts are one MLP of
`moe_num_shared_experts * moe_intermediate_size` every token runs, summed with the routed ones
once (as DeepSeek's, `deepseek.py`). No fusable layer; biases (`use_bias`) refused, as the dense
family's.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.layers.weights import WeightSlice, make_param
from worker_service.models.deepseek import LAYOUT, Float32Router, WithSharedExperts
from worker_service.models.ernie4_5 import Ernie4_5ForCausalLM
from worker_service.models.llama import LlamaDecoderLayer, LlamaMLP
from worker_service.models.moe import ExpertLayout, Routing, RoutesExperts


class Ernie4_5MoE(WithSharedExperts):
    def __init__(self, config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        routing = Routing(config.moe_num_experts, config.moe_k, normalize=True)
        self.norm_min = float(config.moe_norm_min)
        super().__init__(layer, config.hidden_size, config.moe_intermediate_size, routing, LAYOUT, group, dtype,
                         device, backend)
        prefix = f"model.layers.{layer}.mlp"
        self.correction_bias = make_param((1, config.moe_num_experts),
                                          [WeightSlice(f"{prefix}.moe_statics.e_score_correction_bias")],
                                          torch.float32, device)
        self.add_shared(config, layer, config.moe_num_shared_experts, dtype, device)

    def linears(self, prefix: str, layout: ExpertLayout, hidden_size: int, features: range, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.nn.Module, torch.nn.ModuleList, torch.nn.ModuleList]:
        _, gate_up, down = super().linears(prefix, layout, hidden_size, features, dtype, device)
        return Float32Router(f"{prefix}.gate", self.routing.num_experts, hidden_size, False, device), gate_up, down

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probabilities = torch.softmax(self.router(hidden), dim=-1)
        expert_ids = (probabilities + self.correction_bias).topk(self.routing.top_k, dim=-1).indices
        weights = probabilities.gather(1, expert_ids)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)
        return weights.to(hidden.dtype), expert_ids


def ernie4_5_moe_mlp(config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                     backend: Backend) -> torch.nn.Module:
    last = config.moe_layer_end_index
    last = config.num_hidden_layers - 1 if last == -1 else last
    if (layer + 1) % config.moe_layer_interval == 0 and config.moe_layer_start_index <= layer <= last:
        return Ernie4_5MoE(config, layer, group, dtype, device, backend)
    return LlamaMLP(config, layer, group, dtype, device, backend)


class Ernie4_5MoeDecoderLayer(LlamaDecoderLayer):
    mlp_class = staticmethod(ernie4_5_moe_mlp)


class Ernie4_5_MoeForCausalLM(RoutesExperts, Ernie4_5ForCausalLM):
    """Checkpoint names follow Hugging Face's `Ernie4_5_MoeForCausalLM` (experts one by one)."""

    fusable_layer = None
    layer_class = Ernie4_5MoeDecoderLayer
