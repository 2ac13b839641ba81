"""`radixserve up` with a model folder that is not there, a device this torch cannot use, or ports
that cannot all be listened on: one line naming the flag, exit status 1, no traceback, nothing
started."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from procs import ROOT
from radixserve.launcher_config import config_from_args
from radixserve.stack_plan import port_problem


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


def test_ports_that_cannot_all_be_listened_on_are_one_line(smollm2_dir):
    line = _one_line_error(_up("--model", str(smollm2_dir), "--device", "cpu", "--port", "0"))
    assert line.startswith("radixserve up: --port 0: ") and "give a port" in line


@pytest.mark.parametrize("args, expected", [
    (["--port", "65530"], "--port 65530's worker rank 0 of replica 0 would be port 65539, above 65535"),
    (["--port", "60000", "--http-port", "60001"], "--port 60000's router 0 and --http-port 60001"),
    (["--port", "60000", "--metrics-port", "60010", "--tp", "2"],
     "--metrics-port 60010 (the gateway's) and --port 60000's worker rank 1 of replica 0"),
    (["--port", "60000", "--metrics-port", "61000", "--replicas", "2", "--gateways", "2", "--http-port", "61011"],
     "--metrics-port 61000's gateway 1 and --http-port 61011"),
])
def test_each_derived_port_is_checked_against_the_others(args, expected):
    problem = port_problem(config_from_args(["up", "--model", "m", *args]))
    assert problem is not None and problem.startswith(expected), problem


def test_the_default_ports_and_spread_replicas_pass():
    assert port_problem(config_from_args(["up", "--model", "m"])) is None
    assert port_problem(config_from_args(["up", "--model", "m", "--replicas", "8", "--tp", "4",
                                          "--gateways", "4", "--http-port", "8000"])) is None


def test_an_empty_or_foreign_gguf_file_is_one_line(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    line = _one_line_error(_up("--model", str(tmp_path / "empty.gguf"), "--device", "cpu"))
    assert line == f"radixserve up: --model {tmp_path / 'empty.gguf'}: the file is empty"
    (tmp_path / "random.gguf").write_bytes(bytes(range(256)) * 4)
    line = _one_line_error(_up("--model", str(tmp_path / "random.gguf"), "--device", "cpu"))
    assert line.endswith("it is not a GGUF file (it starts with b'\\x00\\x01\\x02\\x03', not b'GGUF')")
