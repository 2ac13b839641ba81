"""The pooling a model folder declares (sentence-transformers files), or why it is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway_service.pooling_config import load_pooling
from radixserve.v1 import worker_pb2

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
DENSE = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}


def folder(tmp_path: Path, modules: list | None, pooling: dict | None = None, hidden: int = 48) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    if modules is not None:
        (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def test_no_sentence_transformers_files_means_last_token_normalised(tmp_path) -> None:
    config = load_pooling(folder(tmp_path, None))
    assert config.problem is None and config.dimensions == 48
    assert config.pooling == worker_pb2.Pooling(mode=worker_pb2.POOLING_MODE_LAST, normalize=True)


@pytest.mark.parametrize(("key", "mode"), [("pooling_mode_lasttoken", worker_pb2.POOLING_MODE_LAST),
                                           ("pooling_mode_mean_tokens", worker_pb2.POOLING_MODE_MEAN)])
@pytest.mark.parametrize("normalize", [True, False])
def test_declared_pooling_is_followed(tmp_path, key, mode, normalize) -> None:
    modules = [TRANSFORMER, POOLING, *([NORMALIZE] if normalize else [])]
    config = load_pooling(folder(tmp_path, modules, {key: True, "pooling_mode_cls_token": False,
                                                     "word_embedding_dimension": 48}))
    assert config.problem is None and config.source == "sentence-transformers"
    assert config.pooling == worker_pb2.Pooling(mode=mode, normalize=normalize)


@pytest.mark.parametrize(("modules", "pooling", "named"), [
    ([TRANSFORMER, POOLING], {"pooling_mode_cls_token": True}, "pooling_mode_cls_token"),
    ([TRANSFORMER, POOLING], {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
    ([TRANSFORMER, POOLING], {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": True}, "lasttoken"),
    ([TRANSFORMER, POOLING], {"pooling_mode_lasttoken": True, "include_prompt": False}, "include_prompt"),
    ([TRANSFORMER, POOLING, DENSE], {"pooling_mode_mean_tokens": True}, "Dense"),
    ([TRANSFORMER], None, "Pooling"),
])
def test_what_cannot_be_served_is_refused_by_name(tmp_path, modules, pooling, named) -> None:
    config = load_pooling(folder(tmp_path, modules, pooling))
    assert config.problem is not None and named in config.problem
