"""AFMoE (`AfmoeForCausalLM`: Arcee's Trinity models): Qwen3's attention (per-head q/k norms) with
its output gated per element by sigmoid(`gate_proj` x) before o_proj; sliding-window layers by
`layer_types` that rotate and full ones that do not (an unrotated table, as SmolLM3's NoPE
layers); norms before and after attention and before and after the MLP (GLM-4's order); the
embeddings scaled by sqrt(hidden) where `mup_enabled`.

Experts after `num_dense_layers` dense layers: the router (`mlp.router.gate`, the model's dtype)
gives sigmoid scores in float32; the choice adds `mlp.expert_bias`; the chosen scores are
renormalised and times `route_scale`; ungated shared experts are added (`deepseek.WithSharedExperts`).
Under TP the gate splits with the query heads. No fusable layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from worker_service.backends.base import Backend, Rope, StepContext
from worker_service.distributed import TPGroup
from worker_service.layers.linear import ColumnParallelLinear
from worker_service.layers.norm import RMSNorm
from worker_service.layers.sharding import shard_heads
from worker_service.layers.weights import WeightSlice, make_param
from worker_service.models.config_checks import BY_LAYER_TYPE
from worker_service.models.deepseek import LAYOUT, WithSharedExperts
from worker_service.models.layer_types import SkipsRopeInSomeLayers
from worker_service.models.llama import LlamaForCausalLM, LlamaMLP, NormsAroundBlocks
from worker_service.models.moe import ExpertLayout, Routing, RoutesExperts
from worker_service.models.qwen3 import Qwen3Attention


class GatedAttention(Qwen3Attention):
    """Qwen3's attention, its output times sigmoid(`gate_proj` x) per element (this rank's heads)."""

    def __init__(self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
                 dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        super().__init__(config, layer, group, qkv_bias, dtype, device, backend)
        heads = shard_heads(config.num_attention_heads, config.num_key_value_heads, group.world_size,
                            group.rank).q_heads
        rows = range(heads.start * self.head_dim, heads.stop * self.head_dim)
        self.gate_proj = ColumnParallelLinear(config.hidden_size, [(f"model.layers.{layer}.self_attn.gate_proj", rows)],
                                              False, dtype, device)

    def forward(self, hidden: torch.Tensor, step: StepContext, rope: Rope) -> torch.Tensor:
        return self.o_proj(self.attend(hidden, step, rope) * torch.sigmoid(self.gate_proj(hidden)))


class AfmoeMoE(WithSharedExperts):
    def __init__(self, config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        routing = Routing(config.num_experts, config.num_experts_per_tok, normalize=True)
        super().__init__(layer, config.hidden_size, config.moe_intermediate_size, routing, LAYOUT, group, dtype,
                         device, backend)
        prefix = f"model.layers.{layer}.mlp"
        self.scale = float(config.route_scale)
        self.expert_bias = make_param((config.num_experts,), [WeightSlice(f"{prefix}.expert_bias")], torch.float32,
                                      device)
        self.add_shared(config, layer, config.num_shared_experts, dtype, device)

    def linears(self, prefix: str, layout: ExpertLayout, hidden_size: int, features: range, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.nn.Module, torch.nn.ModuleList, torch.nn.ModuleList]:
        _, gate_up, down = super().linears(prefix, layout, hidden_size, features, dtype, device)
        router = ColumnParallelLinear(hidden_size, [(f"{prefix}.router.gate", range(self.routing.num_experts))],
                                      False, dtype, device)
        return router, gate_up, down

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.router(hidden).float().sigmoid()
        expert_ids = (scores + self.expert_bias).topk(self.routing.top_k, dim=-1).indices
        weights = scores.gather(1, expert_ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale
        return weights.to(hidden.dtype), expert_ids


class AfmoeDecoderLayer(NormsAroundBlocks, torch.nn.Module):
    def __init__(self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
                 dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        super().__init__()
        prefix, size, eps = f"model.layers.{layer}", config.hidden_size, config.rms_norm_eps
        for name in ("input_layernorm", "post_attention_layernorm", "pre_mlp_layernorm", "post_mlp_layernorm"):
            setattr(self, name, RMSNorm(f"{prefix}.{name}.weight", size, eps, dtype, device, backend))
        self.self_attn = GatedAttention(config, layer, group, qkv_bias, dtype, device, backend)
        self.mlp = (LlamaMLP(config, layer, group, dtype, device, backend) if layer < config.num_dense_layers
                    else AfmoeMoE(config, layer, group, dtype, device, backend))

    def norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm, RMSNorm]:
        return self.input_layernorm, self.post_attention_layernorm, self.pre_mlp_layernorm, self.post_mlp_layernorm


class AfmoeForCausalLM(SkipsRopeInSomeLayers, RoutesExperts, LlamaForCausalLM):
    """Checkpoint names follow Hugging Face's `AfmoeForCausalLM` (experts one by one)."""

    fusable_layer = None
    window_rule = BY_LAYER_TYPE
    layer_class = AfmoeDecoderLayer

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        super().__init__(config, group, dtype, device, backend)
        self.rotate_only([kind == "sliding_attention" for kind in config.layer_types], config, dtype, device)
        self.embedding_scale = math.sqrt(config.hidden_size) if config.mup_enabled else None

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().embed(token_ids)
        return hidden if self.embedding_scale is None else hidden * self.embedding_scale
