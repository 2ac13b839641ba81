"""OLMo 3: OLMo 2's layer (norms after attention and after the MLP, full-width q/k norms), with
sliding-window attention in the layers `layer_types` marks "sliding_attention" (three of every
four by default) and RoPE settings per layer type where `rope_parameters` is keyed by it.

The window is `AttentionOptions.window` (`config_checks.layer_windows`), which PyTorch's ops
compute on every backend (`attention/windowed.py`), as for Gemma's sliding layers; each layer
type rotates by its own tables. No fusable layer (OLMo 2's order of norms). q/k norms over the
whole width leave no room for a partial rotation, which `RotaryEmbedding` refuses.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_service.backends.base import Backend
from worker_service.distributed import TPGroup
from worker_service.models.config_checks import BY_LAYER_TYPE
from worker_service.models.layer_types import RotatesByLayerType, rotaries_by_layer_type
from worker_service.models.olmo2 import Olmo2DecoderLayer, Olmo2ForCausalLM


class Olmo3DecoderLayer(Olmo2DecoderLayer):
    def __init__(self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
                 dtype: torch.dtype, device: torch.device, backend: Backend) -> None:
        super().__init__(config, layer, group, qkv_bias, dtype, device, backend)
        self.layer_type = config.layer_types[layer]


class Olmo3ForCausalLM(RotatesByLayerType, Olmo2ForCausalLM):
    layer_class = Olmo3DecoderLayer
    window_rule = BY_LAYER_TYPE

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        super().__init__(config, group, dtype, device, backend)
        del self.rotary  # one per layer type instead
        self.rotaries = rotaries_by_layer_type(config, dtype, device)

    def after_load(self) -> None:
        """Nothing to reorder: every layer type rotates whole heads."""
