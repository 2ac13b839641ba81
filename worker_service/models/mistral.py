"""Mistral: Llama's layer exactly, with `sliding_window` applied to every layer (v0.1's 4,096).

A window at least as long as the context (or none, as from v0.2 on) never masks a key, so such a
checkpoint is a Llama and takes Llama's fused path; a shorter one is `AttentionOptions.window`
in every layer (PyTorch's ops on every backend: `attention/windowed.py`), and no fused path.
"""

from __future__ import annotations

from worker_service.models.config_checks import EVERY_LAYER
from worker_service.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    window_rule = EVERY_LAYER
