"""Cohere (`CohereForCausalLM`: Command-R, Command-R+ without q/k norms, Aya 23, Aya Expanse) and
Cohere 2 (`Cohere2ForCausalLM`: Command R7B, Command A).

Llama's attention and MLP in a parallel block: one LayerNorm (mean subtracted, no bias, in
float32) feeds both, and both outputs join the residual stream: x + attention(n) + mlp(n), added
in that order as transformers does. RoPE in interleaved pairs (2i, 2i + 1) over whole heads (q/k
rows reordered at load, as GLM's), a final LayerNorm, logits times `logit_scale`. Cohere 2
attends through `sliding_window` with RoPE in the layers `layer_types` marks sliding, and over
everything without RoPE in the others (an unrotated table, as SmolLM3's NoPE layers).

Refused by name: Cohere's `use_qk_norm` (LayerNorms per head over q and k, Command-R+'s), Cohere 2
with sliding layers but no `sliding_window` (transformers' class fails on it).
No fusable layer.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend, Rope, StepContext
from worker_service.distributed import TPGroup
from worker_service.layers.rotary import RotaryEmbedding, served_context
from worker_service.layers.weights import WeightSlice, make_param
from worker_service.models.config_checks import BY_LAYER_TYPE
from worker_service.models.layer_types import SkipsRopeInSomeLayers
from worker_service.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, head_dim_of
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


class CohereDecoderLayer(torch.nn.Module):
    def __init__(self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
                 dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(f"model.layers.{layer}.input_layernorm.weight", config.hidden_size,
                                         config.layer_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(config, layer, group, qkv_bias, dtype, device, backend)
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
        if getattr(config, "use_qk_norm", False):
            raise UnsupportedModel(f"{type(self).__name__} with use_qk_norm=True is not supported")
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
        self.uses_rope = [kind == "sliding_attention" for kind in config.layer_types]
        self.unrotated = RotaryEmbedding(config, head_dim_of(config), served_context(config), dtype, device,
                                         rotate=False)
