"""A sparse mixture-of-experts MLP: a router picks `top_k` of `num_experts` SwiGLU experts per
token and the token's output is their outputs weighted by the router's probabilities.

Routing (the same in Qwen3-MoE, Mixtral and OLMoE): softmax of the router's logits in float32,
the `top_k` largest, renormalised to sum to 1 where the family says so (`normalize`), cast to the
dtype. The experts are computed grouped by expert: the step's (token, choice) pairs are sorted by
expert and each expert multiplies the rows routed to it in one product per projection; its
weighted output is added into its tokens' rows. No expert runs on rows not routed to it.

Tensor parallel: every expert's intermediate dimension is split across ranks exactly as the dense
MLP's (gate/up column-parallel, down row-parallel), and since the weighting and the sum over
experts are linear, a rank adds its experts' partial products and the group sums once per layer.
The router is replicated (every rank routes the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker_service.backends.base import Backend, ExpertExtras, PackedExperts
from worker_service.distributed import TPGroup, all_reduce_sum
from worker_service.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker_service.layers.sharding import aligned_range


# What a model with sparse MoE layers names in `CausalLM.ops_without_kernels`: the routing (top-k,
# the per-expert row counts read back to the host to group rows) runs in PyTorch's ops on every
# backend, and that read-back is also why such steps are never captured as CUDA graphs.
MOE_ROUTING = "mixture-of-experts routing"


class RoutesExperts:
    """Mixed in before a `CausalLM` whose MLPs are `SparseMoE`s: its parent's ops without kernels
    and `MOE_ROUTING`."""

    @classmethod
    def ops_without_kernels(cls, config: Any) -> tuple[str, ...]:
        return super().ops_without_kernels(config) + (MOE_ROUTING,)


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """Where a family keeps a layer's experts: `<block>.gate.weight` is the router,
    `<block>.experts.<e>.<gate|up|down>.weight` expert e's projections."""

    block: str  # e.g. "mlp" (Qwen3-MoE, OLMoE) or "block_sparse_moe" (Mixtral)
    gate: str
    up: str
    down: str


@dataclass(frozen=True, slots=True)
class Routing:
    num_experts: int
    top_k: int
    normalize: bool  # renormalise the chosen probabilities to sum to 1
    # Softmax the top-k logits among themselves (GPT-OSS, Granite-MoE) rather than take the full
    # softmax's top k: the same weights as `normalize`, in those families' order of operations.
    top_logits: bool = False


class SparseMoE(torch.nn.Module):
    # A rank's intermediate features start on a multiple of this (a quantized checkpoint's groups).
    feature_align = 1

    def __init__(self, layer: int, hidden_size: int, intermediate_size: int, routing: Routing,
                 layout: ExpertLayout, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        super().__init__()
        self.routing = routing
        self.group = group
        self.backend = backend
        self.intermediate_size = intermediate_size
        features = aligned_range(intermediate_size, group.world_size, group.rank, self.feature_align)
        self.router, self.gate_up, self.down = self.linears(f"model.layers.{layer}.{layout.block}", layout,
                                                            hidden_size, features, dtype, device)
        self.experts: PackedExperts | None = None  # the backend's grouped product, where it has one (`pack`)

    def linears(self, prefix: str, layout: ExpertLayout, hidden_size: int, features: range, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.nn.Module, torch.nn.ModuleList, torch.nn.ModuleList]:
        """(the router, each expert's gate/up rows (gate first) over this rank's `features`, each
        expert's down columns over them), as the family's checkpoint names them."""
        num_experts = self.routing.num_experts
        router = ColumnParallelLinear(hidden_size, [(f"{prefix}.gate", range(num_experts))], False, dtype, device)
        gate_up = torch.nn.ModuleList(
            ColumnParallelLinear(hidden_size, [(f"{prefix}.experts.{e}.{layout.gate}", features),
                                               (f"{prefix}.experts.{e}.{layout.up}", features)], False, dtype, device)
            for e in range(num_experts))
        down = torch.nn.ModuleList(
            RowParallelLinear(f"{prefix}.experts.{e}.{layout.down}", features, hidden_size, self.group, dtype, device,
                              reduce=False)
            for e in range(num_experts))
        return router, gate_up, down

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """An expert's activation of its gate/up rows `[T, 2 I]` (gate first): SwiGLU here."""
        return self.backend.silu_mul(gate_up)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights `[T, top_k]` in the dtype, expert ids `[T, top_k]`) of every token."""
        if self.routing.top_logits:
            top, expert_ids = self.router(hidden).float().topk(self.routing.top_k, dim=-1)
            return torch.softmax(top, dim=-1).to(hidden.dtype), expert_ids
        probabilities = torch.softmax(self.router(hidden).float(), dim=-1)
        weights, expert_ids = probabilities.topk(self.routing.top_k, dim=-1)
        if self.routing.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(hidden.dtype), expert_ids

    def extras(self) -> ExpertExtras | None:
        """What these experts compute beyond SwiGLU without biases (`ExpertExtras`; None: nothing)."""
        return None

    def pack(self, backend: Backend) -> None:
        """Offer the experts to `backend` as one grouped product (`Backend.pack_experts`, with the
        family's `extras`), before their linear layers are packed one by one; where it takes them,
        those layers multiply views of its weights (kept once) for the steps it leaves to them."""
        if self.experts is not None or self.gate_up[0].packed is not None:
            return
        self.experts = backend.pack_experts([linear.weight.detach() for linear in self.gate_up],
                                            [linear.weight.detach() for linear in self.down], self.extras())
        if self.experts is not None:
            for (gate_up, down), expert_gate_up, expert_down in zip(self.experts.linears(), self.gate_up, self.down):
                expert_gate_up.adopt(gate_up)
                expert_down.adopt(down)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(self.partial(hidden), self.group)

    def partial(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's share of the routed experts' output (the group sums the shares)."""
        weights, expert_ids = self.route(hidden)
        out = None if self.experts is None else self.experts(hidden, expert_ids, weights)
        if out is None:
            out = self.per_expert(hidden, expert_ids, weights)
        return out

    def per_expert(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The grouped product in PyTorch: one gate/up and one down product per routed expert."""
        choices = expert_ids.flatten()
        order = choices.argsort(stable=True)  # (token, choice) pairs grouped by expert
        counts = torch.bincount(choices, minlength=self.routing.num_experts).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros_like(hidden)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start:start + count]
            start += count
            rows = pairs // self.routing.top_k
            expert_out = self.down[expert](self.activate(self.gate_up[expert](hidden.index_select(0, rows))))
            out.index_add_(0, rows, expert_out * flat_weights.index_select(0, pairs).unsqueeze(-1))
        return out
