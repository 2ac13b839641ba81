"""ERNIE 4.5 dense (`Ernie4_5ForCausalLM`: ERNIE-4.5-0.3B): Llama's layer with RoPE in interleaved
pairs (2i, 2i + 1) over whole heads, served as GLM's is (q/k rows reordered at load, see
`RotaryEmbedding`), so it keeps the fused Llama layer. transformers rotates in float32 and rounds
after; the backends rotate in the model's dtype (equal in float32, within rounding in bfloat16).
Biases on every projection (`use_bias`) are refused.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.models.llama import LlamaForCausalLM
from worker_service.unsupported import UnsupportedModel


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    interleaved_rotary = True  # whole heads, whatever partial_rotary_factor says (as transformers' class): refused

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        if getattr(config, "use_bias", False):
            raise UnsupportedModel("Ernie4_5ForCausalLM with use_bias=True is not supported")
        super().__init__(config, group, dtype, device, backend)
