"""Granite: Llama's layer with four scalars from its config.

- `embedding_multiplier` scales the embeddings;
- `residual_multiplier` scales what attention and the MLP add to the residual stream (applied to
  their outputs here, so the residual adds stay the fused norm-with-add);
- `attention_multiplier` replaces 1/sqrt(head_dim) as the softmax scale: the queries are scaled
  by `attention_multiplier * sqrt(head_dim)` before RoPE (a rotation is linear, so this is the same
  product), and the backend's attention applies its usual 1/sqrt(head_dim);
- `logits_scaling` divides the logits.
Its layer is not Llama's, so it declares no fusable layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from worker_service.backends.base import Backend, Rope, StepContext
from worker_service.distributed import TPGroup
from worker_service.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class GraniteAttention(LlamaAttention):
    def __init__(self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
                 dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        super().__init__(config, layer, group, qkv_bias, dtype, device, backend)
        self.query_scale = config.attention_multiplier * math.sqrt(self.head_dim)
        self.output_scale = config.residual_multiplier

    def prepare_qk(self, qkv: torch.Tensor) -> None:
        qkv[:, :self.num_q_heads].mul_(self.query_scale)

    def forward(self, hidden: torch.Tensor, step: StepContext, rope: Rope) -> torch.Tensor:
        return super().forward(hidden, step, rope).mul_(self.output_scale)


class GraniteMLP(LlamaMLP):
    def __init__(self, config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        super().__init__(config, layer, group, dtype, device, backend)
        self.output_scale = config.residual_multiplier

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden).mul_(self.output_scale)


class GraniteDecoderLayer(LlamaDecoderLayer):
    attention_class = GraniteAttention
    mlp_class = GraniteMLP


class GraniteForCausalLM(LlamaForCausalLM):
    fusable_layer = None
    layer_class = GraniteDecoderLayer

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(token_ids) * self.config.embedding_multiplier

    def logits(self, hidden: torch.Tensor, residual: torch.Tensor, sample_indices: torch.Tensor) -> torch.Tensor | None:
        logits = super().logits(hidden, residual, sample_indices)
        return None if logits is None else logits / self.config.logits_scaling
