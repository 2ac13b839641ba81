"""SmolLM3: Llama's layer, with RoPE left out of some layers (`no_rope_layers[i]` is 0 for such a
"NoPE" layer: its queries and keys carry no position, every fourth layer by default).

A NoPE layer goes through the same backend step as the others, with an unrotated table (cos 1,
sin 0: the rotation returns its input exactly), so the backends need nothing of their own. The
compiled whole-layer Llama path applies one table to every layer: no fusable layer. Sliding
windows (`use_sliding_window`) apply to the layers `layer_types` marks, as transformers' class
applies them.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.models.config_checks import BY_LAYER_TYPE
from worker_service.models.layer_types import SkipsRopeInSomeLayers
from worker_service.models.llama import LlamaForCausalLM
from worker_service.unsupported import UnsupportedModel


class SmolLM3ForCausalLM(SkipsRopeInSomeLayers, LlamaForCausalLM):
    """Checkpoint names follow Hugging Face's `SmolLM3ForCausalLM` (Llama's)."""

    fusable_layer = None
    window_rule = BY_LAYER_TYPE

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        uses_rope = [bool(flag) for flag in config.no_rope_layers]
        if len(uses_rope) != config.num_hidden_layers:
            raise UnsupportedModel(f"SmolLM3 with {len(uses_rope)} no_rope_layers entries for "
                                   f"{config.num_hidden_layers} layers")
        super().__init__(config, group, dtype, device, backend)
        self.rotate_only(uses_rope, config, dtype, device)
