"""How this model turns a prompt into one embedding: read once from its folder.

A sentence-transformers checkpoint says it in `modules.json` (the pipeline: Transformer, Pooling,
optionally Normalize) and in the Pooling module's `config.json` (`pooling_mode_lasttoken`,
`pooling_mode_mean_tokens`, ...). The workers can pool the final hidden states by the last token
or by their mean, then normalise (see worker.proto `Pooling`); so:

- no `modules.json`: last-token pooling, normalised: what decoder models trained as embedders
  (e5-mistral, gte-Qwen, Qwen3-Embedding) use, and the only pooling a causal model's last
  position sees the whole prompt for;
- a Transformer, a Pooling with exactly one of last-token or mean, and optionally a Normalize:
  that;
- anything else (CLS or max pooling, prompt exclusion, Dense layers after the pooling, ...):
  embeddings are refused with a message naming what is not supported, never computed otherwise.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from radixserve.v1 import worker_pb2

log = logging.getLogger(__name__)

_MODES = {
    "pooling_mode_lasttoken": worker_pb2.POOLING_MODE_LAST,
    "pooling_mode_mean_tokens": worker_pb2.POOLING_MODE_MEAN,
}
_MODULE = "sentence_transformers.models."
_TRANSFORMER, _POOLING, _NORMALIZE = _MODULE + "Transformer", _MODULE + "Pooling", _MODULE + "Normalize"


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """The model's pooling, or why it cannot be served (`problem`; then `pooling` is unusable).
    `dimensions`: the vector's length (the model's hidden size; 0 when the folder does not say)."""

    pooling: worker_pb2.Pooling
    dimensions: int = 0
    problem: str | None = None
    source: str = "default"

    @property
    def mode_name(self) -> str:
        return worker_pb2.PoolingMode.Name(self.pooling.mode)


def load_pooling(model_dir: str | Path) -> PoolingConfig:
    """The pooling `model_dir` declares (see the module doc)."""
    folder = Path(model_dir)
    dimensions = _hidden_size(folder)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig(worker_pb2.Pooling(mode=worker_pb2.POOLING_MODE_LAST, normalize=True), dimensions)
    try:
        modules = json.loads(modules_file.read_text())
        types = [module["type"] for module in modules]
        pooling_path = next(module.get("path", "") for module in modules if module["type"] == _POOLING)
    except (ValueError, KeyError, TypeError, StopIteration):
        return _refused(dimensions, "modules.json has no readable Pooling module")
    others = [kind for kind in types if kind not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if others:
        return _refused(dimensions, f"modules.json has modules this server does not run: {', '.join(others)}")
    try:
        settings = json.loads((folder / pooling_path / "config.json").read_text())
    except (OSError, ValueError):
        return _refused(dimensions, f"{pooling_path}/config.json is missing or not JSON")
    chosen = [key for key, value in settings.items() if key.startswith("pooling_mode_") and value is True]
    if len(chosen) != 1 or chosen[0] not in _MODES:
        wanted = ", ".join(chosen) or "no pooling mode"
        return _refused(dimensions, f"the model's pooling ({wanted}) is not supported: "
                                    "pooling_mode_lasttoken or pooling_mode_mean_tokens only")
    if settings.get("include_prompt", True) is not True:
        return _refused(dimensions, "the model's pooling excludes the prompt (include_prompt: false), "
                                    "which is not supported")
    dimensions = int(settings.get("word_embedding_dimension") or dimensions)
    pooling = worker_pb2.Pooling(mode=_MODES[chosen[0]], normalize=_NORMALIZE in types)
    return PoolingConfig(pooling, dimensions, source="sentence-transformers")


def _refused(dimensions: int, problem: str) -> PoolingConfig:
    log.warning("embeddings are refused for this model: %s", problem)
    return PoolingConfig(worker_pb2.Pooling(), dimensions, problem=problem)


def _hidden_size(folder: Path) -> int:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    config = config.get("text_config", config)
    return int(config.get("hidden_size") or 0)
