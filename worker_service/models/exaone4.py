"""EXAONE 4.0 (`Exaone4ForCausalLM`): OLMo 2's order of norms (after attention and after the MLP,
none before), Qwen3's per-head q/k norms before RoPE, and with a `sliding_window` its hybrid
attention: the layers `layer_types` marks "sliding_attention" (three of every four) attend
through the window with RoPE, the full ones over everything without RoPE ("NoPE", an unrotated
table as SmolLM3's). Without a window every layer is full and rotates. No fusable layer.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.models.config_checks import BY_LAYER_TYPE
from worker_service.models.layer_types import SkipsRopeInSomeLayers
from worker_service.models.olmo2 import Olmo2DecoderLayer, Olmo2ForCausalLM
from worker_service.models.qwen3 import Qwen3Attention


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    attention_class = Qwen3Attention


class Exaone4ForCausalLM(SkipsRopeInSomeLayers, Olmo2ForCausalLM):
    layer_class = Exaone4DecoderLayer
    window_rule = BY_LAYER_TYPE

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        super().__init__(config, group, dtype, device, backend)
        hybrid = config.sliding_window is not None  # as transformers decides which layers rotate
        self.rotate_only([not hybrid or kind == "sliding_attention" for kind in config.layer_types], config, dtype,
                         device)
