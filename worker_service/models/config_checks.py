"""Load-time refusals of checkpoint features a family's implementation does not have.

Each raises `UnsupportedModel` naming the family and the feature (or the architecture), which the
worker reports in one line as its reason for not starting: a refused checkpoint never runs a
computation that differs from the reference.
"""

from __future__ import annotations

from typing import Any

from worker_service.unsupported import UnsupportedModel


def refuse_sliding_window(config: Any, family: str) -> None:
    """Refuse a window shorter than the context: windows are not implemented for `family`, and
    full attention would compute something else once a sequence outgrows one. A window at least
    as long as the context (or none) never masks a key."""
    window = getattr(config, "sliding_window", None)
    used = getattr(config, "use_sliding_window", window is not None)
    if used and window is not None and window < config.max_position_embeddings:
        raise UnsupportedModel(f"{family} with sliding-window attention (sliding_window={window} < "
                         f"max_position_embeddings={config.max_position_embeddings}) is not supported")
