"""Qwen2: the Llama computation with biases on the q/k/v projections."""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.models.config_checks import refuse_sliding_window
from worker_service.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Its layer is Llama's with a q/k/v bias, which the fused Llama layer takes: it stays `"llama"`."""

    qkv_bias = True

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        refuse_sliding_window(config, "Qwen2")
        super().__init__(config, group, dtype, device, backend)
