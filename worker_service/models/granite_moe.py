"""Granite-MoE (`GraniteMoeForCausalLM`: granite-3.0/3.1 1b-a400m and 3b-a800m): Granite's layer
(its four multipliers, `granite.py`) with a sparse mixture of SwiGLU experts in place of the MLP.

The experts are stored in two 3-D tensors under `block_sparse_moe`: `input_linear.weight`
`[experts, 2 I, hidden]` (each expert's gate rows, then its up rows) and `output_linear.weight`
`[experts, hidden, I]`; each expert's matrices are read from them as our linear layers, a rank's
share of the features only (`WeightSlice.expert`). The router (`router.layer`, no bias) softmaxes
its top `num_experts_per_tok` logits among themselves. The experts' output is scaled by
`residual_multiplier`, as Granite's MLP's is. No fusable layer.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker_service.layers.weights import WeightSlice
from worker_service.models.granite import GraniteDecoderLayer, GraniteForCausalLM
from worker_service.models.moe import ExpertLayout, Routing, RoutesExperts, SparseMoE

LAYOUT = ExpertLayout("block_sparse_moe", "input_linear", "input_linear", "output_linear")


class GraniteMoE(SparseMoE):
    def __init__(self, config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        routing = Routing(config.num_local_experts, config.num_experts_per_tok, normalize=True, top_logits=True)
        super().__init__(layer, config.hidden_size, config.intermediate_size, routing, LAYOUT, group, dtype,
                         device, backend)
        self.output_scale = config.residual_multiplier

    def linears(self, prefix: str, layout: ExpertLayout, hidden_size: int, features: range, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.nn.Module, torch.nn.ModuleList, torch.nn.ModuleList]:
        num_experts, width = self.routing.num_experts, self.intermediate_size
        router = ColumnParallelLinear(hidden_size, [(f"{prefix}.router.layer", range(num_experts))], False, dtype,
                                      device)
        gate_up_name, down_name = f"{prefix}.{layout.gate}.weight", f"{prefix}.{layout.down}.weight"
        up = range(width + features.start, width + features.stop)
        gate_up = torch.nn.ModuleList(
            ColumnParallelLinear(hidden_size, [], False, dtype, device,
                                 weight_slices=[WeightSlice(gate_up_name, rows, expert=e) for rows in (features, up)])
            for e in range(num_experts))
        down = torch.nn.ModuleList(
            RowParallelLinear(down_name, features, hidden_size, self.group, dtype, device, reduce=False,
                              weight=WeightSlice(down_name, cols=features, expert=e))
            for e in range(num_experts))
        return router, gate_up, down

    def partial(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().partial(hidden).mul_(self.output_scale)


class GraniteMoeDecoderLayer(GraniteDecoderLayer):
    mlp_class = GraniteMoE


class GraniteMoeForCausalLM(RoutesExperts, GraniteForCausalLM):
    """Checkpoint names follow Hugging Face's `GraniteMoeForCausalLM`."""

    layer_class = GraniteMoeDecoderLayer
