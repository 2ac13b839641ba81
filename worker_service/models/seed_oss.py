"""Seed-OSS (`SeedOssForCausalLM`: Seed-OSS-36B): Llama's layer with biases on q/k/v, Qwen2's
computation, so it keeps the fused Llama layer. A bias on the output projection
(`attention_out_bias`) or none on q/k/v is refused by name."""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.models.llama import LlamaForCausalLM
from worker_service.unsupported import UnsupportedModel


class SeedOssForCausalLM(LlamaForCausalLM):
    qkv_bias = True

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        for setting, served in (("attention_bias", True), ("attention_out_bias", False)):
            if getattr(config, setting, served) != served:
                raise UnsupportedModel(f"SeedOssForCausalLM with {setting}={not served} is not supported")
        super().__init__(config, group, dtype, device, backend)
