"""OLMo 2: norms after attention and after the MLP instead of before, and an RMSNorm over the
whole query and the whole key projection before RoPE (`WidthNorm`).

Per layer: h = x + norm_a(attention(x)); out = h + norm_f(mlp(h)). The q/k norms' statistic is
over all heads, which under tensor parallelism spans every rank: `WidthNorm` adds the ranks'
partial sums. A split that replicates KV heads (more ranks than KV heads) would count a key head
twice, so it is refused. No fusable layer: the order of norms is not Llama's.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend, Rope, StepContext
from worker_service.distributed import TPGroup
from worker_service.layers.norm import RMSNorm
from worker_service.layers.qk_norm import WidthNorm
from worker_service.layers.sharding import shard_heads
from worker_service.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, head_dim_of
from worker_service.unsupported import UnsupportedModel


class WidthNormAttention(LlamaAttention):
    """Llama's attention with OLMo's full-width q/k norms (OLMo 2, OLMoE)."""

    def __init__(self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
                 dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        if group.world_size > config.num_key_value_heads:
            raise UnsupportedModel(f"TP={group.world_size} would replicate this model's {config.num_key_value_heads} "
                             "KV heads, which its full-width key norm cannot take; use TP <= the KV head count")
        super().__init__(config, layer, group, qkv_bias, dtype, device, backend)
        heads = shard_heads(config.num_attention_heads, config.num_key_value_heads, group.world_size, group.rank)
        d, eps = head_dim_of(config), config.rms_norm_eps
        prefix = f"model.layers.{layer}.self_attn"
        self.q_norm = WidthNorm(f"{prefix}.q_norm.weight", range(heads.q_heads.start * d, heads.q_heads.stop * d),
                                config.num_attention_heads * d, eps, group, dtype, device)
        self.k_norm = WidthNorm(f"{prefix}.k_norm.weight", range(heads.kv_heads.start * d, heads.kv_heads.stop * d),
                                config.num_key_value_heads * d, eps, group, dtype, device)

    def prepare_qk(self, qkv: torch.Tensor) -> None:
        self.q_norm(qkv, 0, self.num_q_heads)
        self.k_norm(qkv, self.num_q_heads, self.num_kv_heads)


class Olmo2DecoderLayer(torch.nn.Module):
    attention_class: type[WidthNormAttention] = WidthNormAttention

    def __init__(self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
                 dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        super().__init__()
        prefix, eps, hidden = f"model.layers.{layer}", config.rms_norm_eps, config.hidden_size
        self.self_attn = self.attention_class(config, layer, group, qkv_bias, dtype, device, backend)
        self.post_attention_layernorm = RMSNorm(f"{prefix}.post_attention_layernorm.weight", hidden, eps, dtype,
                                                device, backend)
        self.mlp = LlamaMLP(config, layer, group, dtype, device, backend)
        self.post_feedforward_layernorm = RMSNorm(f"{prefix}.post_feedforward_layernorm.weight", hidden, eps,
                                                  dtype, device, backend)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, step: StepContext,
                rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """As `LlamaDecoderLayer.forward`: (this layer's normed MLP output, the residual before it)."""
        if residual is not None:
            hidden = residual + hidden
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, step, rope))
        return self.post_feedforward_layernorm(self.mlp(hidden)), hidden


class Olmo2ForCausalLM(LlamaForCausalLM):
    fusable_layer = None
    layer_class = Olmo2DecoderLayer
