"""Granite 4.0 (`GraniteMoeHybridForCausalLM`) with attention in every layer (its non-hybrid models,
as granite-4.0-micro) and Granite-MoE with a shared MLP (`GraniteMoeSharedForCausalLM`): Granite's layer (its
multipliers, `granite.py`) whose MLP is a shared SwiGLU MLP every token runs
(`shared_mlp.input_linear`: gate rows, then up rows; `shared_mlp.output_linear`), plus Granite-MoE's
routed experts (`granite_moe.py`) where `num_local_experts` > 0. Both outputs are scaled by
`residual_multiplier` and summed across ranks once. Granite 4.0 rotates where
`position_embedding_type` is "rope" and otherwise not at all (an unrotated table).

Refused by name: Granite 4.0's Mamba layers (`layer_types` "linear_attention": the -h models),
whose recurrent state the paged KV cache does not hold.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup, all_reduce_sum
from worker_service.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker_service.layers.sharding import balanced_range
from worker_service.models.granite import GraniteDecoderLayer, GraniteForCausalLM
from worker_service.models.granite_moe import GraniteMoE
from worker_service.models.layer_types import SkipsRopeInSomeLayers
from worker_service.models.moe import MOE_ROUTING, RoutesExperts
from worker_service.unsupported import UnsupportedModel

ATTENTION_LAYERS = ("attention", "full_attention")


class SharedMLP(torch.nn.Module):
    """`shared_mlp`: SwiGLU over this rank's features, its output scaled and left to the caller's sum."""

    def __init__(self, config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        super().__init__()
        self.backend = backend
        prefix, width = f"model.layers.{layer}.shared_mlp", config.shared_intermediate_size
        features = balanced_range(width, group.world_size, group.rank)
        up = range(width + features.start, width + features.stop)
        self.gate_up = ColumnParallelLinear(config.hidden_size, [(f"{prefix}.input_linear", features),
                                                                 (f"{prefix}.input_linear", up)], False, dtype, device)
        self.down = RowParallelLinear(f"{prefix}.output_linear", features, config.hidden_size, group, dtype, device,
                                      reduce=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down(self.backend.silu_mul(self.gate_up(hidden)))


class SharedAndRoutedMLP(torch.nn.Module):
    """The shared MLP, plus the routed experts where the model has them, scaled and summed once."""

    def __init__(self, config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        super().__init__()
        self.group = group
        self.scale = config.residual_multiplier
        self.shared = (SharedMLP(config, layer, group, dtype, device, backend)
                       if config.shared_intermediate_size else None)
        self.experts = (GraniteMoE(config, layer, group, dtype, device, backend)
                        if getattr(config, "num_local_experts", 0) else None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = None if self.experts is None else self.experts.partial(hidden)  # scaled by the experts
        if self.shared is not None:
            shared = self.shared(hidden).mul_(self.scale)
            out = shared if out is None else out + shared
        return all_reduce_sum(out, self.group)


class GraniteHybridDecoderLayer(GraniteDecoderLayer):
    mlp_class = SharedAndRoutedMLP


class GraniteMoeSharedForCausalLM(RoutesExperts, GraniteForCausalLM):
    """Checkpoint names follow Hugging Face's `GraniteMoeSharedForCausalLM`."""

    layer_class = GraniteHybridDecoderLayer


class GraniteMoeHybridForCausalLM(SkipsRopeInSomeLayers, GraniteMoeSharedForCausalLM):
    """Checkpoint names follow Hugging Face's `GraniteMoeHybridForCausalLM` (attention layers only)."""

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        others = sorted({kind for kind in config.layer_types if kind not in ATTENTION_LAYERS})
        if others:
            raise UnsupportedModel(f"GraniteMoeHybridForCausalLM with {others} layers (Mamba) is not supported: "
                                   "attention in every layer only")
        super().__init__(config, group, dtype, device, backend)
        rotates = config.position_embedding_type == "rope"
        self.rotate_only([rotates] * config.num_hidden_layers, config, dtype, device)

    @classmethod
    def ops_without_kernels(cls, config: Any) -> tuple[str, ...]:
        """Without routed experts (granite-4.0-micro's dense layers), no MoE routing either."""
        base = super().ops_without_kernels(config)
        return base if getattr(config, "num_local_experts", 0) else tuple(op for op in base if op != MOE_ROUTING)
