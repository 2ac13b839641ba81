"""Apertus (`ApertusForCausalLM`: Apertus-8B, -70B): Qwen3's attention (per-head q/k norms) with a
non-gated MLP, down(xIELU(up x)), under Llama's order of norms (named `attention_layernorm` and
`feedforward_layernorm` in its checkpoints).

xIELU, with each layer's learned `alpha_p` and `alpha_n` (stored before their softplus) and its
`beta` and `eps`: for x > 0, softplus(alpha_p) x^2 + beta x; else
(expm1(min(x, eps)) - x)(beta + softplus(alpha_n)) + beta x. Elementwise with scalars, so every
rank applies it to its own features. Computed in float32 from float32 parameters. No fusable layer.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker_service.layers.norm import RMSNorm
from worker_service.layers.sharding import balanced_range
from worker_service.layers.weights import WeightSlice, make_param
from worker_service.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from worker_service.models.qwen3 import Qwen3Attention
from worker_service.unsupported import UnsupportedModel


class XieluMLP(torch.nn.Module):
    def __init__(self, config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        super().__init__()
        if config.hidden_act != "xielu":
            raise UnsupportedModel(f"ApertusForCausalLM with hidden_act={config.hidden_act!r} is not supported "
                                   "(only xielu)")
        prefix = f"model.layers.{layer}.mlp"
        features = balanced_range(config.intermediate_size, group.world_size, group.rank)
        self.up_proj = ColumnParallelLinear(config.hidden_size, [(f"{prefix}.up_proj", features)], False, dtype,
                                            device)
        self.down_proj = RowParallelLinear(f"{prefix}.down_proj", features, config.hidden_size, group, dtype, device)
        for name, shape in (("alpha_p", (1,)), ("alpha_n", (1,)), ("beta", ()), ("eps", ())):
            setattr(self, name, make_param(shape, [WeightSlice(f"{prefix}.act_fn.{name}")], torch.float32, device))

    def xielu(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        alpha_p = torch.nn.functional.softplus(self.alpha_p)
        alpha_n = self.beta + torch.nn.functional.softplus(self.alpha_n)
        negative = (torch.expm1(torch.minimum(x32, self.eps)) - x32) * alpha_n + self.beta * x32
        return torch.where(x32 > 0, alpha_p * x32 * x32 + self.beta * x32, negative).to(x.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.xielu(self.up_proj(hidden)))


class ApertusDecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention
    mlp_class = XieluMLP

    def __init__(self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
                 dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        super().__init__(config, layer, group, qkv_bias, dtype, device, backend)
        # Llama's two norms by Apertus' names: before attention, before the MLP.
        prefix, size, eps = f"model.layers.{layer}", config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(f"{prefix}.attention_layernorm.weight", size, eps, dtype, device, backend)
        self.post_attention_layernorm = RMSNorm(f"{prefix}.feedforward_layernorm.weight", size, eps, dtype, device,
                                                backend)


class ApertusForCausalLM(LlamaForCausalLM):
    """Checkpoint names follow Hugging Face's `ApertusForCausalLM`."""

    fusable_layer = None
    layer_class = ApertusDecoderLayer
