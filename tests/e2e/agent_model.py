"""The agent tests' model: its served name, the stack's default max_tokens, and the
sentence-transformers files that make it declare mean-pooled, normalised embeddings."""

from __future__ import annotations

import json
from pathlib import Path

AGENT_MODEL = "tiny-agent"
AGENT_MAX_TOKENS = 64
AGENT_TIMEOUT_S = 60.0  # one client call


def write_mean_pooling(folder: Path) -> None:
    """A sentence-transformers pipeline in `folder`: mean pooling, then normalisation."""
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False,
         "pooling_mode_cls_token": False, "include_prompt": True}))
