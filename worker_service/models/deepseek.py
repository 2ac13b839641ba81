"""DeepSeek-V2 (`DeepseekV2ForCausalLM`: DeepSeek-V2, V2-Lite, V2.5) and DeepSeek-V3
(`DeepseekV3ForCausalLM`: DeepSeek-V3, R1, V3.1 and others of its shape): Llama's
order of norms with multi-head latent attention (`mla.py`) and a mixture of experts of their own.

- **Experts**: `n_routed_experts` SwiGLU experts (`moe_intermediate_size`), top
  `num_experts_per_tok` per token, plus `n_shared_experts` always-on experts held as one MLP of
  `n_shared_experts * moe_intermediate_size` (no gate), added to the routed ones. The first
  `first_k_dense_replace` layers have a dense MLP (`intermediate_size`) instead.
- **Routing**, in float32 from a float32 router (transformers keeps `mlp.gate` so):
  - V2: softmax over every expert; `group_limited_greedy` first keeps the `topk_group` of
    `n_group` groups whose best expert scores highest; the chosen probabilities are not
    renormalised.
  - V3: sigmoid scores; the choice adds `e_score_correction_bias` and keeps the `topk_group`
    groups whose two best biased scores sum highest; the weights are the unbiased scores of the
    chosen, renormalised where `norm_topk_prob`.
  - Both multiply the weights by `routed_scaling_factor`.
  The router's rows are padded to `ROW_TILE` (a row's bits whatever the step holds).
- Tensor parallel: experts and the shared MLP split by their intermediate features, as every
  MoE family here; the group sums routed and shared outputs once per layer.

No fusable layer; the compiled grouped-expert call takes the routed experts where the backend
has it. Not served: FP8 checkpoints (DeepSeek-V3's release: refused by name as any unsupported
`quantization_config`), the multi-token-prediction layer (never read), GGUF files.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup, all_reduce_sum
from worker_service.layers.rotary import RotaryEmbedding, served_context
from worker_service.layers.weights import WeightSlice, make_param
from worker_service.models.layer_types import RotatesItself, unrotated_table
from worker_service.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from worker_service.models.mla import MlaAttention, latent_width
from worker_service.models.moe import ExpertLayout, Routing, RoutesExperts, SparseMoE
from worker_service.row_tiles import padded_rows
from worker_service.unsupported import UnsupportedModel

LAYOUT = ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj")


class Float32Router(torch.nn.Module):
    """`mlp.gate`: router weights (and V3's score correction bias) kept and multiplied in float32."""

    def __init__(self, prefix: str, num_experts: int, hidden_size: int, correction_bias: bool,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = make_param((num_experts, hidden_size), [WeightSlice(f"{prefix}.weight")], torch.float32, device)
        self.correction_bias = (make_param((num_experts,), [WeightSlice(f"{prefix}.e_score_correction_bias")],
                                           torch.float32, device) if correction_bias else None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        return torch.nn.functional.linear(padded_rows(hidden.float()), self.weight)[:rows]


class WithSharedExperts(SparseMoE):
    """Routed experts plus `shared` (ungated experts every token runs, one MLP split across ranks
    like the routed ones, or None), summed across ranks once (DeepSeek's, ERNIE 4.5's)."""

    shared: LlamaMLP | None  # set by `add_shared` (annotated only: a class attribute would hide the module)

    def add_shared(self, config: Any, layer: int, count: int, dtype: torch.dtype, device: torch.device) -> None:
        """`count` shared experts of `moe_intermediate_size` as one MLP (`mlp.shared_experts`), or none."""
        self.shared = (LlamaMLP(config, layer, self.group, dtype, device, self.backend,
                                f"model.layers.{layer}.mlp.shared_experts", config.moe_intermediate_size * count,
                                reduce=False) if count else None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.partial(hidden)
        if self.shared is not None:
            out = out + self.shared(hidden)
        return all_reduce_sum(out, self.group)


class DeepseekMoE(WithSharedExperts):
    """The routed experts (routed as the module doc says: V2's here, the class attributes below
    for the others) and the shared ones, summed once."""

    sigmoid_scores = False  # sigmoid scores with a correction bias for the choice (V3); else softmax
    top_two_groups = False  # groups ranked by their two best scores' sum (V3); else by their best
    reads_norm_topk_prob = False  # whether `norm_topk_prob` renormalises (V2's never does)

    def __init__(self, config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        routing = Routing(config.n_routed_experts, config.num_experts_per_tok,
                          normalize=bool(self.reads_norm_topk_prob and config.norm_topk_prob))
        self.scaling = float(config.routed_scaling_factor)
        groups = getattr(config, "n_group", None) or 1
        self.groups = (groups, getattr(config, "topk_group", None) or groups) if self.grouped(config) else (1, 1)
        if config.n_routed_experts % self.groups[0]:
            raise UnsupportedModel(f"{config.n_routed_experts} experts in {self.groups[0]} groups")
        super().__init__(layer, config.hidden_size, config.moe_intermediate_size, routing, LAYOUT, group, dtype,
                         device, backend)
        self.add_shared(config, layer, config.n_shared_experts, dtype, device)

    @staticmethod
    def grouped(config: Any) -> bool:
        """Whether routing keeps only the best groups: V2's greedy routing ignores its groups, as
        transformers' does."""
        return config.topk_method == "group_limited_greedy"

    def linears(self, prefix: str, layout: ExpertLayout, hidden_size: int, features: range, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.nn.Module, torch.nn.ModuleList, torch.nn.ModuleList]:
        _, gate_up, down = super().linears(prefix, layout, hidden_size, features, dtype, device)
        router = Float32Router(f"{prefix}.gate", self.routing.num_experts, hidden_size, self.sigmoid_scores, device)
        return router, gate_up, down

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.router(hidden)
        scores = logits.sigmoid() if self.sigmoid_scores else torch.softmax(logits, dim=-1)
        choice = scores if self.router.correction_bias is None else scores + self.router.correction_bias
        num_groups, kept_groups = self.groups
        if kept_groups < num_groups:
            per_group = choice.view(choice.shape[0], num_groups, -1)
            group_scores = (per_group.topk(2, dim=-1).values.sum(dim=-1) if self.top_two_groups
                            else per_group.max(dim=-1).values)
            kept = torch.zeros_like(group_scores, dtype=torch.bool)
            kept.scatter_(1, group_scores.topk(kept_groups, dim=-1).indices, True)
            dropped = (~kept).unsqueeze(-1).expand_as(per_group).reshape(choice.shape)
            choice = choice.masked_fill(dropped, float("-inf") if self.sigmoid_scores else 0.0)
        expert_ids = choice.topk(self.routing.top_k, dim=-1).indices
        weights = scores.gather(1, expert_ids)
        if self.routing.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.scaling).to(hidden.dtype), expert_ids


class DeepseekV3MoE(DeepseekMoE):
    sigmoid_scores = True
    top_two_groups = True
    reads_norm_topk_prob = True

    @staticmethod
    def grouped(config: Any) -> bool:
        return True


def dense_until(moe_class: type[DeepseekMoE]):
    """A layer's MLP: dense in the first `first_k_dense_replace` layers, `moe_class` after."""
    def build(config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
              backend: Backend) -> torch.nn.Module:
        if layer < config.first_k_dense_replace:
            return LlamaMLP(config, layer, group, dtype, device, backend)
        return moe_class(config, layer, group, dtype, device, backend)
    return staticmethod(build)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    attention_class = MlaAttention
    mlp_class = dense_until(DeepseekMoE)


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    attention_class = MlaAttention
    mlp_class = dense_until(DeepseekV3MoE)


class DeepseekV2ForCausalLM(RotatesItself, RoutesExperts, LlamaForCausalLM):
    """Checkpoint names follow Hugging Face's `DeepseekV2ForCausalLM` (experts one by one)."""

    fusable_layer = None
    layer_class = DeepseekV2DecoderLayer
    values_are_keys = True  # the latent row is the one KV head's key and value: the pool holds it once

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        self.check(config)
        super().__init__(config, group, dtype, device, backend)
        self.num_kv_heads = 1  # the latent row, every rank's whole (`mla.py`)
        # RoPE over q_pe and k_pe only, in the checkpoint's pairs; the backend's tables rotate nothing.
        self.rotary = RotaryEmbedding(config, config.qk_rope_head_dim, served_context(config), dtype, device,
                                      interleaved=self.interleaved(config))
        self.unrotated = unrotated_table(config, dtype, device, latent_width(config))

    @classmethod
    def check(cls, config: Any) -> None:
        """Refuse what transformers' class does not compute as the checkpoint means it."""
        if getattr(config, "moe_layer_freq", 1) != 1:
            raise UnsupportedModel(f"{cls.__name__} with moe_layer_freq={config.moe_layer_freq} is not supported")
        if getattr(config, "topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
            raise UnsupportedModel(f"{cls.__name__} with topk_method={config.topk_method!r} is not supported")
        if getattr(config, "norm_topk_prob", False):  # transformers' V2 never renormalises; DeepSeek's code would
            raise UnsupportedModel(f"{cls.__name__} with norm_topk_prob=True is not supported")

    @staticmethod
    def interleaved(config: Any) -> bool:
        return True  # V2's rotation is over complex pairs (2i, 2i + 1)

    @classmethod
    def kv_cache_geometry(cls, config: Any) -> tuple[int, int]:
        return 1, latent_width(config)

    def after_load(self) -> None:
        super().after_load()  # the rotated rows in the rotation's order (`MlaAttention.reorder_qk`)
        for layer in self.layers:
            layer.self_attn.absorb()



class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """Checkpoint names follow Hugging Face's `DeepseekV3ForCausalLM` (experts one by one; its
    multi-token-prediction layer is not read)."""

    layer_class = DeepseekV3DecoderLayer

    @classmethod
    def check(cls, config: Any) -> None:
        if getattr(config, "topk_method", "noaux_tc") != "noaux_tc":
            raise UnsupportedModel(f"{cls.__name__} with topk_method={config.topk_method!r} is not supported")
        if getattr(config, "scoring_func", "sigmoid") != "sigmoid":
            raise UnsupportedModel(f"{cls.__name__} with scoring_func={config.scoring_func!r} is not supported")
        if getattr(config, "moe_layer_freq", 1) != 1:
            raise UnsupportedModel(f"{cls.__name__} with moe_layer_freq={config.moe_layer_freq} is not supported")

    @staticmethod
    def interleaved(config: Any) -> bool:
        return bool(getattr(config, "rope_interleave", True))
