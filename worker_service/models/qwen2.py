"""Qwen2: the Llama computation with biases on the q/k/v projections (and, with
`use_sliding_window`, windowed attention in the layers `layer_types` marks sliding)."""

from __future__ import annotations

from worker_service.models.config_checks import BY_LAYER_TYPE
from worker_service.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Its layer is Llama's with a q/k/v bias, which the fused Llama layer takes: it stays `"llama"`."""

    qkv_bias = True
    window_rule = BY_LAYER_TYPE  # `use_sliding_window`: the layers from `max_window_layers` on
