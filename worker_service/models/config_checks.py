"""Load-time refusals of checkpoint features a family's implementation does not have.

Each raises `UnsupportedModel` naming the family and the feature (or the architecture), which the
worker reports in one line as its reason for not starting: a refused checkpoint never runs a
computation that differs from the reference.
"""

from __future__ import annotations

from typing import Any

from worker_service.unsupported import UnsupportedModel


# How transformers' class for a family applies `sliding_window` (`layer_windows`).
EVERY_LAYER = "every layer"  # Mistral, Mixtral, Phi-3, Qwen3-MoE
BY_LAYER_TYPE = "by layer type"  # the layers `layer_types` marks "sliding_attention": Qwen2, Qwen3, SmolLM3, OLMo 3
IGNORED = "ignored"  # Llama, Granite, OLMo 2, OLMoE: the setting is not read


def layer_windows(config: Any, rule: str) -> list[int | None]:
    """Each layer's sliding window (a query sees its last `window` positions) as transformers
    applies the family's `sliding_window` by `rule`; None where a layer attends to every
    position, as with a window at least as long as the context, which never masks a key."""
    window = getattr(config, "sliding_window", None)
    layers = config.num_hidden_layers
    if rule == IGNORED or not window or window >= config.max_position_embeddings:
        return [None] * layers
    if window < 0:
        raise UnsupportedModel(f"sliding_window={window} is not a window")
    if rule == EVERY_LAYER:
        return [window] * layers
    if len(config.layer_types) != layers:
        raise UnsupportedModel(f"{len(config.layer_types)} layer_types for {layers} layers")
    return [window if kind == "sliding_attention" else None for kind in config.layer_types]


def refuse_sliding_window(config: Any, family: str) -> None:
    """Refuse a window shorter than the context where the family's windows are not followed
    (Qwen2-MoE: transformers' own class fails on them, so there is no reference to hold them
    to). A window at least as long as the context (or none) never masks a key."""
    window = getattr(config, "sliding_window", None)
    used = getattr(config, "use_sliding_window", window is not None)
    if used and window is not None and window < config.max_position_embeddings:
        raise UnsupportedModel(f"{family} with sliding-window attention (sliding_window={window} < "
                         f"max_position_embeddings={config.max_position_embeddings}) is not supported")
