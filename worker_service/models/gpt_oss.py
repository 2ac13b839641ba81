"""GPT-OSS (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b): Llama's order of norms with biases on
q/k/v and o, attention sinks, sliding-window attention in the layers `layer_types` marks (every
other one, a window of 128), YaRN RoPE, and a sparse mixture of experts of its own kind.

- **Sinks**: each query head has one learned logit (`self_attn.sinks`) that joins its softmax's
  denominator and attends to nothing, so a query's weights sum to less than 1. It is
  `AttentionOptions.sinks`: the compiled CPU kernel adds it where it merges its partial sums
  (`csrc/paged_attention.cpp`), the invariant backend after its chunks' merge
  (`attention/invariant.py`), the PyTorch backend from its attention's log-sum-exps
  (`torch_backend.with_sinks`); Triton, and every backend for a sliding layer a sequence
  outgrows, attend with PyTorch's ops (`attention/windowed.py`). TP splits them with the query
  heads.
- **Experts** are stored in 3-D tensors, `gate_up_proj` `[experts, hidden, 2 I]` (gate and up
  features interleaved: gate at even columns, up at odd) and `down_proj` `[experts, I, hidden]`,
  each with a bias. Each expert's matrices are read as our linear layers' `[out, in]`
  (`WeightSlice.expert`, `transposed`), gate features first. The activation clamps the gate
  (above) and up (both sides) at `swiglu_limit`, then (up + 1) * gate * sigmoid(gate *
  `swiglu_alpha`). The router has a bias; it takes the top `num_experts_per_tok` logits and
  softmaxes those. Under TP the down bias is added by rank 0 alone (`RowParallelLinear`).

No fusable layer. The compiled grouped-expert call takes its biases and clamped SwiGLU
(`ExpertExtras`) where the backend has it; elsewhere the experts are each layer's own products.
In bfloat16 RMSNorm rounds as Llama's does (weight times the normalised row rounded to the
dtype), where transformers' GPT-OSS rounds once after the weight.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import ATTENTION_SINKS, AttentionOptions, Backend, ExpertExtras
from worker_service.distributed import TPGroup
from worker_service.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker_service.layers.sharding import shard_heads
from worker_service.layers.weights import WeightSlice, make_param
from worker_service.models.config_checks import BY_LAYER_TYPE
from worker_service.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from worker_service.models.moe import ExpertLayout, Routing, RoutesExperts, SparseMoE
from worker_service.quant import mxfp4
from worker_service.unsupported import UnsupportedModel

LAYOUT = ExpertLayout("mlp", "gate_up_proj", "gate_up_proj", "down_proj")


class GptOssAttention(LlamaAttention):
    o_bias = True

    def __init__(self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
                 dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        super().__init__(config, layer, group, qkv_bias, dtype, device, backend)
        q_heads = shard_heads(config.num_attention_heads, config.num_key_value_heads,
                              group.world_size, group.rank).q_heads
        # float32 whatever the dtype (the kernels take them so; a bfloat16 checkpoint's are exact in it).
        self.sinks = make_param((len(q_heads),), [WeightSlice(f"model.layers.{layer}.self_attn.sinks", q_heads)],
                                torch.float32, device)
        self.options = AttentionOptions(sinks=self.sinks)


class GptOssMoE(SparseMoE):
    feature_align = mxfp4.GROUP  # an MXFP4 checkpoint's groups stay whole on every rank

    def __init__(self, config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        routing = Routing(config.num_local_experts, config.num_experts_per_tok, normalize=True, top_logits=True)
        super().__init__(layer, config.hidden_size, config.intermediate_size, routing, LAYOUT, group, dtype,
                         device, backend)
        self.limit = float(config.swiglu_limit)
        self.alpha = float(config.swiglu_alpha)

    def linears(self, prefix: str, layout: ExpertLayout, hidden_size: int, features: range, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.nn.Module, torch.nn.ModuleList, torch.nn.ModuleList]:
        num_experts = self.routing.num_experts
        router = ColumnParallelLinear(hidden_size, [(f"{prefix}.router", range(num_experts))], True, dtype, device)
        gate_up_name, down_name = f"{prefix}.experts.{layout.gate}", f"{prefix}.experts.{layout.down}"
        # This rank's gate features at even columns, its up features at the odd ones after them.
        halves = (range(2 * features.start, 2 * features.stop, 2), range(2 * features.start + 1, 2 * features.stop, 2))
        gate_up = torch.nn.ModuleList(
            ColumnParallelLinear(
                hidden_size, [], True, dtype, device,
                weight_slices=[WeightSlice(gate_up_name, rows, expert=e, transposed=True) for rows in halves],
                bias_slices=[WeightSlice(f"{gate_up_name}_bias", rows, expert=e) for rows in halves])
            for e in range(num_experts))
        down = torch.nn.ModuleList(
            RowParallelLinear(down_name, features, hidden_size, self.group, dtype, device, reduce=False, bias=True,
                              weight=WeightSlice(down_name, cols=features, expert=e, transposed=True),
                              bias_slice=WeightSlice(f"{down_name}_bias", expert=e))
            for e in range(num_experts))
        return router, gate_up, down

    def extras(self) -> ExpertExtras:
        """The biases (the down ones on rank 0 only) and the clamped SwiGLU, for a grouped product."""
        down_bias = None if self.down[0].bias is None else [linear.bias.detach() for linear in self.down]
        return ExpertExtras([linear.bias.detach() for linear in self.gate_up], down_bias, self.limit, self.alpha)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_class = GptOssAttention
    mlp_class = GptOssMoE


class GptOssForCausalLM(RoutesExperts, LlamaForCausalLM):
    """Checkpoint names follow Hugging Face's `GptOssForCausalLM`: its experts plain, or as MXFP4
    blocks (the released checkpoints), which are kept as int8 (`quant/mxfp4.py`)."""

    qkv_bias = True
    fusable_layer = None
    window_rule = BY_LAYER_TYPE
    layer_class = GptOssDecoderLayer

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        if not getattr(config, "attention_bias", True):
            raise UnsupportedModel("GptOssForCausalLM with attention_bias=False is not supported")
        super().__init__(config, group, dtype, device, backend)

    @classmethod
    def ops_without_kernels(cls, config: Any) -> tuple[str, ...]:
        return (ATTENTION_SINKS,) + super().ops_without_kernels(config)
