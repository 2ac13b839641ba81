"""Cohere (`CohereForCausalLM`: Command-R, Command-R+, Aya 23, Aya Expanse) and
Cohere 2 (`Cohere2ForCausalLM`: Command R7B, Command A).

Llama's attention and MLP in a parallel block: one LayerNorm (mean subtracted, no bias, in
float32) feeds both, and both outputs join the residual stream: x + attention(n) + mlp(n), added
in that order as transformers does. RoPE in interleaved pairs (2i, 2i + 1) over whole heads (q/k
rows reordered at load, as GLM's), a final LayerNorm, logits times `logit_scale`. Cohere 2
attends through `sliding_window` with RoPE in the layers `layer_types` marks sliding, and over
everything without RoPE in the others (an unrotated table, as SmolLM3's NoPE layers).

Cohere's `use_qk_norm` (Command-R+): a LayerNorm over each q and k head with a weight per head,
before RoPE. Refused by name: Cohere 2 with sliding layers but no `sliding_window` (transformers'
class fails on it).
No fusable layer.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend, Rope, StepContext
from worker_service.distributed import TPGroup
from worker_service.layers.sharding import shard_heads
from worker_service.layers.weights import WeightSlice, make_param
from worker_service.models.config_checks import BY_LAYER_TYPE
from worker_service.models.layer_types import SkipsRopeInSomeLayers
from worker_service.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from worker_service.unsupported import UnsupportedModel


class LayerNorm(torch.nn.Module):
    """Cohere's LayerNorm: (x - mean) / sqrt(var + eps) times the weight, in float32, then cast.
    Row-wise, so a row's bits do not depend on the step's other rows."""

    def __init__(self, name: str, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_param((size,), [WeightSlice(name)], dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = torch.nn.functional.layer_norm(x.float(), x.shape[-1:], self.weight.float(), None, self.eps)
        return normed.to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of `residual + x`, `residual + x`), as `RMSNorm.add`."""
        residual = residual + x
        return self(residual), residual


class HeadLayerNormAttention(LlamaAttention):
    """Command-R+'s attention: a LayerNorm over each q and k head's dims, with a weight per head
    (`q_norm.weight` `[heads, head_dim]`, this rank's heads), before RoPE; its weights follow the
    rows into the rotation's order at load (`norms_follow_order`)."""

    norms_follow_order = True

    def __init__(self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
                 dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        super().__init__(config, layer, group, qkv_bias, dtype, device, backend)
        heads = shard_heads(config.num_attention_heads, config.num_key_value_heads, group.world_size, group.rank)
        prefix = f"model.layers.{layer}.self_attn"
        self.eps = config.layer_norm_eps
        self.q_norm = make_param((self.num_q_heads, self.head_dim),
                                 [WeightSlice(f"{prefix}.q_norm.weight", heads.q_heads)], dtype, device)
        self.k_norm = make_param((self.num_kv_heads, self.head_dim),
                                 [WeightSlice(f"{prefix}.k_norm.weight", heads.kv_heads)], dtype, device)

    def prepare_qk(self, qkv: torch.Tensor) -> None:
        for first, weight in ((0, self.q_norm), (self.num_q_heads, self.k_norm)):
            heads = qkv[:, first:first + weight.shape[0]]
            x = heads.float()
            normed = torch.nn.functional.layer_norm(x, x.shape[-1:], None, None, self.eps) * weight.float()
            heads.copy_(normed.to(qkv.dtype))

    def reorder_qk(self, order: torch.Tensor) -> None:
        super().reorder_qk(order)
        for weight in (self.q_norm, self.k_norm):
            weight.data = weight.data.index_select(1, order.to(weight.device))


class CohereDecoderLayer(torch.nn.Module):
    def __init__(self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
                 dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(f"model.layers.{layer}.input_layernorm.weight", config.hidden_size,
                                         config.layer_norm_eps, dtype, device)
        attention = HeadLayerNormAttention if getattr(config, "use_qk_norm", False) else LlamaAttention
        self.self_attn = attention(config, layer, group, qkv_bias, dtype, device, backend)
        self.mlp = LlamaMLP(config, layer, group, dtype, device, backend)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, step: StepContext,
                rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """As `LlamaDecoderLayer.forward`: (the MLP's output, the residual with attention's added),
        which the next norm adds in transformers' order."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add(hidden, residual)
        return self.mlp(normed), residual + self.self_attn(normed, step, rope)


class CohereForCausalLM(LlamaForCausalLM):
    """Checkpoint names follow Hugging Face's `CohereForCausalLM`."""

    fusable_layer = None
    interleaved_rotary = True
    layer_class = CohereDecoderLayer

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        super().__init__(config, group, dtype, device, backend)
        self.logit_scale = float(config.logit_scale)

    def final_norm(self, config: Any, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        return LayerNorm("model.norm.weight", config.hidden_size, config.layer_norm_eps, dtype, device)

    def logits(self, hidden: torch.Tensor, residual: torch.Tensor, sample_indices: torch.Tensor) -> torch.Tensor | None:
        logits = super().logits(hidden, residual, sample_indices)
        return None if logits is None else logits * self.logit_scale


class Cohere2ForCausalLM(SkipsRopeInSomeLayers, CohereForCausalLM):
    """Checkpoint names follow Hugging Face's `Cohere2ForCausalLM`."""

    window_rule = BY_LAYER_TYPE

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        if config.sliding_window is None and "sliding_attention" in config.layer_types:
            # transformers' class fails on it: no reference to hold it to.
            raise UnsupportedModel("Cohere2ForCausalLM with sliding layers and sliding_window=None is not supported")
        super().__init__(config, group, dtype, device, backend)
        # As transformers decides: a layer rotates where it attends through a window.
        self.rotate_only([kind == "sliding_attention" for kind in config.layer_types], config, dtype, device)
