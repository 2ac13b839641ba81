"""MiniMax-M2 (`MiniMaxM2ForCausalLM`: MiniMax-M2, M2.1): Llama's order of norms with OLMo's
full-width q/k RMSNorm before RoPE, RoPE over the first `rotary_dim` of each head in halves
(`partial_rotary_factor`; rows reordered at load, as Phi-3's, the norms' weights with them), and a
sparse mixture of SwiGLU experts stored as Mixtral's (`block_sparse_moe.experts.<e>.w1/w3/w2`).

Routing: sigmoid of the router's logits in float32; the choice adds `e_score_correction_bias`
(`block_sparse_moe.e_score_correction_bias`), the weights are the chosen unbiased scores
renormalised to sum to 1. No shared expert, no groups. Under TP, as OLMo 2: TP <= the KV heads
(the full-width key norm). In bfloat16 the q/k norms round as OLMo's (weight times the float32
normalised row, rounded once), where transformers' MiniMax-M2 rounds the row before the weight:
equal in float32, where the tests compare. No fusable layer.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.layers.weights import WeightSlice, make_param
from worker_service.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from worker_service.models.mixtral import LAYOUT
from worker_service.models.moe import Routing, RoutesExperts, SparseMoE
from worker_service.models.olmo2 import WidthNormAttention


class ReorderedWidthNormAttention(WidthNormAttention):
    """OLMo's full-width q/k norms whose weights follow each head's rows into the rotation's order
    (the mean of squares over the width does not depend on it)."""

    norms_follow_order = True

    def reorder_qk(self, order: torch.Tensor) -> None:
        super().reorder_qk(order)
        d = self.head_dim
        for norm in (self.q_norm, self.k_norm):
            heads = norm.weight.numel() // d
            norm.weight.data = norm.weight.data.view(heads, d).index_select(1, order.to(norm.weight.device)).flatten()


class MiniMaxM2MoE(SparseMoE):
    def __init__(self, config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        routing = Routing(config.num_local_experts, config.num_experts_per_tok, normalize=True)
        super().__init__(layer, config.hidden_size, config.intermediate_size, routing, LAYOUT, group, dtype, device,
                         backend)
        self.correction_bias = make_param(
            (config.num_local_experts,), [WeightSlice(f"model.layers.{layer}.{LAYOUT.block}.e_score_correction_bias")],
            torch.float32, device)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.router(hidden).float().sigmoid()
        expert_ids = (scores + self.correction_bias).topk(self.routing.top_k, dim=-1).indices
        weights = scores.gather(1, expert_ids)
        return (weights / weights.sum(dim=-1, keepdim=True)).to(hidden.dtype), expert_ids


class MiniMaxM2DecoderLayer(LlamaDecoderLayer):
    attention_class = ReorderedWidthNormAttention
    mlp_class = MiniMaxM2MoE


class MiniMaxM2ForCausalLM(RoutesExperts, LlamaForCausalLM):
    """Checkpoint names follow Hugging Face's `MiniMaxM2ForCausalLM`."""

    fusable_layer = None
    partial_rotary = True
    layer_class = MiniMaxM2DecoderLayer
