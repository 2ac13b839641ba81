"""`radixserve up` with a model folder that is not there, or a device this torch cannot use:
one line naming the flag, exit status 1, no traceback, nothing started."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from procs import ROOT


def _up(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixserve.launcher", "up", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr and "started" not in done.stdout, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_missing_model_folder_is_one_line(tmp_path):
    line = _one_line_error(_up("--model", str(tmp_path / "missing"), "--device", "cpu"))
    assert line.startswith("radixserve up: --model ") and "is not a folder" in line
    line = _one_line_error(_up("--model", str(tmp_path), "--device", "cpu"))
    assert "has no config.json" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot use CUDA")
def test_cuda_on_a_torch_without_it_is_one_line(smollm2_dir):
    line = _one_line_error(_up("--model", str(smollm2_dir), "--device", "cuda"))
    assert line.startswith("radixserve up: --device cuda, but this torch")
