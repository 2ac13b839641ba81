"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with a sparse
mixture-of-experts MLP that adds a shared expert to the routed ones.

The shared expert is a `LlamaMLP` of `shared_expert_intermediate_size` that every token runs,
its output scaled per token by sigmoid(`shared_expert_gate` · x) and added to the routed experts'
(`moe.SparseMoE`: top `num_experts_per_tok` of `num_experts`, renormalised when
`norm_topk_prob`). Tensor parallel: the shared expert's intermediate dimension is split like any
LlamaMLP's, its output left to the caller's sum; its gate (one output) is replicated, and since
the scaling is per token it applies to each rank's partial product, so the group still sums
once per layer, routed and shared together. Layers in `mlp_only_layers` or off the
`decoder_sparse_step` stride keep a dense MLP. No fusable layer."""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup, all_reduce_sum
from worker_service.layers.linear import ColumnParallelLinear
from worker_service.models.config_checks import refuse_sliding_window
from worker_service.models.llama import LlamaDecoderLayer, LlamaMLP
from worker_service.models.moe import Routing, RoutesExperts, SparseMoE
from worker_service.models.qwen2 import Qwen2ForCausalLM
from worker_service.models.qwen3_moe import LAYOUT, is_sparse
from worker_service.unsupported import UnsupportedModel


class SharedExpertMoE(SparseMoE):
    """The routed experts plus the gated shared expert, summed over the group once."""

    def __init__(self, config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        routing = Routing(config.num_experts, config.num_experts_per_tok, bool(config.norm_topk_prob))
        super().__init__(layer, config.hidden_size, config.moe_intermediate_size, routing, LAYOUT, group, dtype,
                         device, backend)
        prefix = f"model.layers.{layer}.mlp"
        self.shared_expert = LlamaMLP(config, layer, group, dtype, device, backend, f"{prefix}.shared_expert",
                                      config.shared_expert_intermediate_size, reduce=False)
        self.shared_gate = ColumnParallelLinear(config.hidden_size, [(f"{prefix}.shared_expert_gate", range(1))],
                                                False, dtype, device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = row_sigmoid(self.shared_gate(hidden)) * self.shared_expert(hidden)
        return all_reduce_sum(self.partial(hidden) + shared, self.group)


def row_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid of each row's one value `[T, 1]`, as the softmax of [x, 0]: computed row by row,
    so a row's bits do not depend on the step's other rows (`--deterministic`). torch.sigmoid
    over `[T, 1]` takes its vector or its scalar path by the row's place in the step, and the two
    round differently. Within 1e-7 of torch.sigmoid in float32."""
    pair = torch.cat([x, torch.zeros_like(x)], dim=-1)
    return torch.softmax(pair, dim=-1, dtype=torch.float32)[:, :1].to(x.dtype)


def qwen2_moe_mlp(config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                  backend: Backend) -> torch.nn.Module:
    if not is_sparse(config, layer):
        return LlamaMLP(config, layer, group, dtype, device, backend)
    return SharedExpertMoE(config, layer, group, dtype, device, backend)


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    mlp_class = staticmethod(qwen2_moe_mlp)


class Qwen2MoeForCausalLM(RoutesExperts, Qwen2ForCausalLM):
    """Checkpoint names follow Hugging Face's `Qwen2MoeForCausalLM`."""

    fusable_layer = None
    layer_class = Qwen2MoeDecoderLayer

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        if not getattr(config, "qkv_bias", True):
            raise UnsupportedModel("Qwen2-MoE with qkv_bias=False is not supported")
        refuse_sliding_window(config, "Qwen2-MoE")
        super().__init__(config, group, dtype, device, backend)
