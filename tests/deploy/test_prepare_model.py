"""Defect 5: the prepared model folder is readable by every uid, whatever wrote it.

safetensors writes `model.safetensors` with mode 0600, so a service running as another uid
(a different APP_UID, Kubernetes runAsUser) could not read the model. prepare_model sets the
modes before the folder is renamed into place, and repairs a complete folder from before.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from radixserve import prepare_model

OTHER_UID = 65534  # nobody
READ_TIMEOUT_S = 30


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder that every user may enter (pytest's tmp_path is private to its owner)."""
    folder = Path(tempfile.mkdtemp(prefix="radixserve-model-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        subprocess.run(["rm", "-rf", str(folder)], check=True, timeout=READ_TIMEOUT_S)


def _write_model(folder: Path) -> None:
    """The files of a complete model folder, written as convert() writes them."""
    folder.mkdir(parents=True)
    save_file({"w": torch.zeros(2, 2)}, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text("{}")


def _readable_as(uid: int, path: Path) -> bool:
    """Can a process running as `uid` read the first byte of `path`? (`head`, not this
    interpreter: that may live where other users cannot go.)"""
    done = subprocess.run(["head", "-c", "1", str(path)], user=uid, capture_output=True,
                          timeout=READ_TIMEOUT_S)
    return done.returncode == 0


def test_safetensors_writes_a_private_file(tmp_path: Path) -> None:
    """The cause: this is why the modes must be set, not inherited from the umask."""
    _write_model(tmp_path / "m")
    assert _mode(tmp_path / "m" / "model.safetensors") & stat.S_IROTH == 0


def test_publish_leaves_every_file_readable(tmp_path: Path) -> None:
    partial, out = tmp_path / "m.partial", tmp_path / "m"
    old_umask = os.umask(0o077)  # even a private umask gives a shared folder
    try:
        _write_model(partial)
        (partial / "sub").mkdir()
        (partial / "sub" / "x.json").write_text("{}")
    finally:
        os.umask(old_umask)
    out.mkdir()  # an older copy is replaced
    prepare_model.publish(partial, out)
    assert not partial.exists()
    assert _mode(out) == _mode(out / "sub") == 0o755
    assert {p.name: _mode(p) for p in out.rglob("*") if p.is_file()} == {
        name: 0o644 for name in ("model.safetensors", "config.json", "tokenizer.json",
                                 "tokenizer_config.json", "x.json")}


def test_ready_folder_from_before_is_repaired(tmp_path: Path, capsys) -> None:
    out = tmp_path / "m"
    _write_model(out)
    (out / "config.json").chmod(0o600)
    prepare_model.main(["--out", str(out), "--cache", str(tmp_path / "cache")])
    assert "is ready" in capsys.readouterr().out
    assert _mode(out / "model.safetensors") == _mode(out / "config.json") == 0o644
    assert not (tmp_path / "cache").exists()  # nothing downloaded


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_another_uid_reads_the_published_model(shared_dir: Path) -> None:
    partial, out = shared_dir / "m.partial", shared_dir / "m"
    _write_model(partial)
    assert not _readable_as(OTHER_UID, partial / "model.safetensors")  # the defect, as written
    prepare_model.publish(partial, out)
    assert _readable_as(OTHER_UID, out / "model.safetensors")
    assert _readable_as(OTHER_UID, out / "config.json")
