"""Our own model implementations, chosen by the checkpoint's `architectures` entry."""

from __future__ import annotations

from typing import Any

from worker_service.models.base import CausalLM
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.qwen2 import Qwen2ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def model_class(config: Any) -> type[CausalLM]:
    """The class for `config.architectures[0]`; ValueError for an architecture we do not have."""
    architectures = getattr(config, "architectures", None) or []
    for name in architectures:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    raise ValueError(f"unsupported architecture {architectures}; supported: {sorted(MODEL_CLASSES)}")
