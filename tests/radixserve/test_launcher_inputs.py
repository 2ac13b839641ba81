"""`radixserve up` with a model folder that is not there, a device this torch cannot use, or ports
that cannot all be listened on (or that something already listens on): one line naming the flag, exit status 1, no traceback, nothing
started. And what it decides itself from its inputs: the gateway processes when unset."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from procs import ROOT
from radixserve import launcher_config
from radixserve.launcher_config import config_from_args, default_gateways, workers_on_cuda
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


@pytest.mark.parametrize("offset, owner", [(0, "--port {p} (the gateway)"), (2, "--port {p}'s router 1"),
                                           (10, "--port {p}'s worker rank 0 of replica 1")])
def test_a_port_something_listens_on_is_one_line_naming_it(smollm2_dir, offset, owner):
    """Another stack left running: its router would answer this one's health checks (ready, and
    half the connections to a stranger); refused before anything starts."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        taken.listen()
        base = port - offset
        line = _one_line_error(_up("--model", str(smollm2_dir), "--device", "cpu", "--port", str(base),
                                   "--http-port", "0", "--metrics-port", "0", "--replicas", "2"))
    assert line == (f"radixserve up: {owner.format(p=base)}: port {port} on 127.0.0.1 is in use (another "
                    "radixserve up still running?): stop it, or give another --port")


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


@pytest.mark.parametrize("on_cuda, num_cores, expected", [
    (False, 2, 1), (False, 64, 1),  # CPU workers: the gateway shares the cores with the forward pass
    (True, 2, 1), (True, 4, 1), (True, 8, 2), (True, 12, 3), (True, 16, 3), (True, 128, 3),
])
def test_unset_gateways_follow_the_device_and_the_cores(on_cuda, num_cores, expected):
    assert default_gateways(on_cuda, num_cores) == expected


def test_gateways_given_are_kept_and_unset_is_decided_for_the_workers_device(monkeypatch):
    assert config_from_args(["up", "--gateways", "5", "--device", "cuda"]).gateways == 5
    assert config_from_args(["up", "--device", "cpu"]).gateways == 1
    monkeypatch.setattr(launcher_config.os, "cpu_count", lambda: 16)
    assert config_from_args(["up", "--device", "cuda"]).gateways == 3
    assert config_from_args(["up", "--device", "cpu"]).gateways == 1
    with pytest.raises(SystemExit):
        config_from_args(["up", "--gateways", "0"])


def test_an_unset_device_is_the_workers_default():
    assert workers_on_cuda("cuda") and not workers_on_cuda("cpu")
    assert workers_on_cuda(None) == torch.cuda.is_available()
