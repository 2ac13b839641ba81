"""GLM (`GlmForCausalLM`: GLM-4-9B-chat's "-hf" checkpoints, GLM-Edge) and GLM-4
(`Glm4ForCausalLM`: GLM-4-0414, GLM-Z1).

GLM is Llama's layer with biases on q/k/v (`attention_bias`), gate and up stored as one
`gate_up_proj` (Phi-3's), and RoPE over the first `partial_rotary_factor` of each head (0.5) in
interleaved pairs (2i, 2i + 1). The rotation is served on the whole-head layout, as Phi-3's
partial one: q and k rows are put at load in the order `rotary_order(..., interleaved=True)`
gives, so every backend's rotation computes it; the layer stays the fused Llama layer. GLM-4 adds a norm after
attention and after the MLP (`post_self_attn_layernorm`, `post_mlp_layernorm`) before each joins
the residual stream: no fusable layer.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.layers.norm import RMSNorm
from worker_service.models.llama import LlamaDecoderLayer, LlamaForCausalLM, NormsAroundBlocks
from worker_service.models.phi3 import Phi3MLP
from worker_service.unsupported import UnsupportedModel


class GlmDecoderLayer(LlamaDecoderLayer):
    mlp_class = Phi3MLP


class GlmForCausalLM(LlamaForCausalLM):
    layer_class: type[LlamaDecoderLayer] = GlmDecoderLayer
    qkv_bias = True
    partial_rotary = True
    interleaved_rotary = True

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        if not getattr(config, "attention_bias", True):
            raise UnsupportedModel(f"{type(self).__name__} with attention_bias=False is not supported")
        super().__init__(config, group, dtype, device, backend)


class Glm4DecoderLayer(NormsAroundBlocks, GlmDecoderLayer):
    def __init__(self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
                 dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        super().__init__(config, layer, group, qkv_bias, dtype, device, backend)
        prefix, size, eps = f"model.layers.{layer}", config.hidden_size, config.rms_norm_eps
        self.post_self_attn_layernorm = RMSNorm(f"{prefix}.post_self_attn_layernorm.weight", size, eps, dtype,
                                                device, backend)
        self.post_mlp_layernorm = RMSNorm(f"{prefix}.post_mlp_layernorm.weight", size, eps, dtype, device, backend)

    def norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm, RMSNorm]:
        # GLM-4's checkpoint calls the norm before the MLP `post_attention_layernorm`.
        return (self.input_layernorm, self.post_self_attn_layernorm, self.post_attention_layernorm,
                self.post_mlp_layernorm)


class Glm4ForCausalLM(GlmForCausalLM):
    fusable_layer = None
    layer_class = Glm4DecoderLayer
