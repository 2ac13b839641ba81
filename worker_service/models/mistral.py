"""Mistral: Llama's layer exactly, where the checkpoint's attention is not windowed.

A `sliding_window` at least as long as the context (or none, as from v0.2 on) never masks a key,
so such a checkpoint is a Llama and takes Llama's fused path. A shorter window is refused at load
(`refuse_sliding_window`): windowed attention is not implemented for this family.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.models.config_checks import refuse_sliding_window
from worker_service.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        refuse_sliding_window(config, "Mistral")
        super().__init__(config, group, dtype, device, backend)
