"""Gemma 2 and Gemma 3 (text) as one tensor-parallel rank computes them.

What differs from Llama, all of it here:
- norms are `GemmaRMSNorm` (x / rms(x) * (1 + weight), float32 throughout), and each layer has
  four: before and after attention, before and after the MLP (the "after" ones normalise the
  branch's output before it joins the residual stream);
- the embeddings are scaled by sqrt(hidden_size) (rounded to the dtype first, as the reference);
- the MLP gates with GELU (tanh approximation): `Backend.gelu_tanh_mul`;
- attention scales scores by `query_pre_attn_scalar ** -0.5`, may soft-cap them
  (`attn_logit_softcapping`; Gemma 2 only: transformers' Gemma 3 keeps the setting but never
  applies it, and the weights were trained without it), and layers of type "sliding_attention" see only the last
  `sliding_window` positions (`AttentionOptions`, computed by PyTorch's ops on every backend:
  `attention/windowed.py`); the final logits may be soft-capped (`final_logit_softcapping`);
- Gemma 3 adds a per-head `GemmaRMSNorm` on q and k before RoPE, and its sliding and full layers
  rotate with their own RoPE settings (`rope_parameters` per layer type).
`use_bidirectional_attention` (an encoder such as EmbeddingGemma: every position sees the later
ones) is refused: a cached prefix would have to be recomputed as each token arrives.
Its layer is not Llama's: no fusable layer.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import AttentionOptions, Backend, Rope, StepContext
from worker_service.distributed import TPGroup
from worker_service.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker_service.layers.gemma_norm import GemmaRMSNorm
from worker_service.layers.sharding import shard_heads
from worker_service.models.base import CausalLM
from worker_service.models.layer_types import RotatesByLayerType, rotaries_by_layer_type
from worker_service.models.llama import LlamaAttention, LlamaMLP, head_dim_of
from worker_service.unsupported import UnsupportedModel

SLIDING = "sliding_attention"


def attention_softcap(config: Any) -> float | None:
    """The attention logits' soft cap: Gemma 2's setting; Gemma 3 has none (see the module doc)."""
    if config.model_type.startswith("gemma3"):
        return None
    return getattr(config, "attn_logit_softcapping", None)


def layer_options(config: Any, layer: int) -> AttentionOptions:
    sliding = config.layer_types[layer] == SLIDING
    return AttentionOptions(window=config.sliding_window if sliding else None, softcap=attention_softcap(config),
                            scale=config.query_pre_attn_scalar ** -0.5)


class GemmaAttention(LlamaAttention):
    qk_norm = False  # Gemma 3's per-head q/k norms

    def __init__(self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
                 dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        super().__init__(config, layer, group, qkv_bias, dtype, device, backend)
        self.options = layer_options(config, layer)
        self.qk_norms = None
        if self.qk_norm:
            prefix, d = f"model.layers.{layer}.self_attn", head_dim_of(config)
            self.qk_norms = torch.nn.ModuleList(
                GemmaRMSNorm(f"{prefix}.{name}.weight", d, config.rms_norm_eps, dtype, device)
                for name in ("q_norm", "k_norm"))

    def prepare_qk(self, qkv: torch.Tensor) -> None:
        if self.qk_norms is not None:
            q, k = qkv[:, :self.num_q_heads], qkv[:, self.num_q_heads:self.num_q_heads + self.num_kv_heads]
            q.copy_(self.qk_norms[0](q))
            k.copy_(self.qk_norms[1](k))


class Gemma3Attention(GemmaAttention):
    qk_norm = True


class GemmaMLP(LlamaMLP):
    activation = "gelu_pytorch_tanh"

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.backend.gelu_tanh_mul(gate_up)


class GemmaDecoderLayer(torch.nn.Module):
    attention_class: type[GemmaAttention] = GemmaAttention

    def __init__(self, config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer]
        prefix, size, eps = f"model.layers.{layer}", config.hidden_size, config.rms_norm_eps
        self.self_attn = self.attention_class(config, layer, group, False, dtype, device, backend)
        self.mlp = GemmaMLP(config, layer, group, dtype, device, backend)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, GemmaRMSNorm(f"{prefix}.{name}.weight", size, eps, dtype, device))

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, step: StepContext,
                rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """As `LlamaDecoderLayer.forward`: (this layer's normed MLP output, the residual before it)."""
        if residual is not None:
            hidden = residual + hidden
        hidden = hidden + self.post_attention_layernorm(self.self_attn(self.input_layernorm(hidden), step, rope))
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden))), hidden


class Gemma3DecoderLayer(GemmaDecoderLayer):
    attention_class = Gemma3Attention


class Gemma2ForCausalLM(RotatesByLayerType, CausalLM):
    layer_class: type[GemmaDecoderLayer] = GemmaDecoderLayer

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        super().__init__()
        if getattr(config, "attention_bias", False):
            raise UnsupportedModel(f"{type(self).__name__} with attention_bias=True is not supported")
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModel(f"{type(self).__name__} with use_bidirectional_attention=True (an encoder: "
                                   "each position sees the later ones) is not supported")
        self.backend = backend
        self.config = config
        self.num_kv_heads = shard_heads(config.num_attention_heads, config.num_key_value_heads,
                                        group.world_size, group.rank).num_kv_heads
        self.embed_tokens = VocabParallelEmbedding("model.embed_tokens.weight", config.vocab_size,
                                                   config.hidden_size, group, dtype, device)
        self.layers = torch.nn.ModuleList(self.layer_class(config, i, group, dtype, device, backend)
                                          for i in range(config.num_hidden_layers))
        self.rotaries = rotaries_by_layer_type(config, dtype, device)
        self.norm = GemmaRMSNorm("model.norm.weight", config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = ParallelLMHead("lm_head.weight", config.vocab_size, config.hidden_size, group, dtype,
                                      device, tied_to=self.embed_tokens if config.tie_word_embeddings else None)

    @classmethod
    def ops_without_kernels(cls, config: Any) -> tuple[str, ...]:
        ops = ["GELU-tanh gating", "attention scaled by query_pre_attn_scalar"]
        if SLIDING in config.layer_types:
            ops.append("sliding-window attention")
        if attention_softcap(config) is not None:
            ops.append("attention logit soft-capping")
        return tuple(ops)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(token_ids)
        return hidden * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype)

    def logits(self, hidden: torch.Tensor, residual: torch.Tensor, sample_indices: torch.Tensor) -> torch.Tensor | None:
        hidden = (hidden + residual).index_select(0, sample_indices)
        logits = self.lm_head(self.norm(hidden))
        cap = getattr(self.config, "final_logit_softcapping", None)
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model: Gemma 2's with q/k norms and RoPE per layer type (see the module doc)."""

    layer_class = Gemma3DecoderLayer
