"""The image's torch check (deploy/image/torch_build.py), run as the build runs it: as a script,
against fake `torch` packages that report a given version and CUDA / ROCm runtime (and, for
the variations of its logic, against the same fakes in process)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from deploy_checks import ROOT

SCRIPT = ROOT / "deploy" / "image" / "torch_build.py"
_spec = importlib.util.spec_from_file_location("torch_build", SCRIPT)
torch_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torch_build)
PYPROJECT = ROOT / "pyproject.toml"
PIN = "2.13.0"


def _fake_site(root: Path, version: str, cuda: str | None = None, hip: str | None = None,
               distributions: tuple[str, ...] = ()) -> Path:
    """A folder holding a `torch` package that reports these values, plus empty dist-infos."""
    site = root / "site"
    package = site / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"from torch import version\n__version__ = {version!r}\n")
    (package / "version.py").write_text(f"cuda = {cuda!r}\nhip = {hip!r}\n")
    for name in distributions:
        info = site / f"{name.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    return site


def _check(site: Path | None, *args: str) -> subprocess.CompletedProcess:
    """`python torch_build.py check ...` with `site` first on the path (None: the real torch)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if site is not None:
        env["PYTHONPATH"] = str(site)
    return subprocess.run([sys.executable, str(SCRIPT), "check", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_pin_reads_pyproject() -> None:
    shown = subprocess.run([sys.executable, str(SCRIPT), "pin", str(PYPROJECT)],
                           capture_output=True, text=True, timeout=30, check=True)
    assert shown.stdout.strip() == PIN
    assert f'"torch=={PIN}"' in PYPROJECT.read_text()


def test_pin_refuses_a_pyproject_without_one_torch_pin(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\ndependencies = ["torch>=2"]\n')
    shown = subprocess.run([sys.executable, str(SCRIPT), "pin", str(pyproject)],
                           capture_output=True, text=True, timeout=30)
    assert shown.returncode != 0
    assert "torch==X" in shown.stderr


def test_cuda_torch_fails_the_cpu_image(tmp_path: Path) -> None:
    """The defect: the CUDA wheel from PyPI installed where the CPU build was asked for."""
    site = _fake_site(tmp_path, PIN, cuda="12.8", distributions=("nvidia-cublas-cu12",))
    result = _check(site, "--version", PIN, "--variant", "cpu")
    assert result.returncode == 1
    assert f"torch {PIN} is a CUDA 12.8 build, but the image asked for the CPU build" in result.stderr
    assert "CUDA packages are installed on the CPU image: nvidia-cublas-cu12" in result.stderr


def _fake_torch(version: str, cuda: str | None = None, hip: str | None = None) -> ModuleType:
    """The same fake, in process, for the variations of the check's logic."""
    torch = ModuleType("torch")
    torch.__version__ = version
    torch.version = SimpleNamespace(cuda=cuda, hip=hip)
    return torch


@pytest.mark.parametrize(
    ("version", "cuda", "hip", "variant", "message"),
    [
        (f"{PIN}+cpu", None, None, "cu128", "is a CPU build, but the image asked for cu128 (CUDA 12.8)"),
        (f"{PIN}+cu126", "12.6", None, "cu128", "is a CUDA 12.6 build"),
        (f"{PIN}+rocm6.4", None, "6.4", "cpu", "is a ROCm 6.4 build"),
        ("2.12.0+cpu", None, None, "cpu", "not the pinned 2.13.0"),
    ],
    ids=["cpu-on-cuda-image", "other-cuda", "rocm-on-cpu-image", "other-version"],
)
def test_check_fails_on_the_wrong_build(
    version: str, cuda: str | None, hip: str | None, variant: str, message: str
) -> None:
    errors = torch_build.build_errors(_fake_torch(version, cuda, hip), PIN, variant, [])
    assert any(message in error for error in errors), errors


@pytest.mark.parametrize(
    ("version", "cuda", "variant"),
    [(f"{PIN}+cpu", None, "cpu"), (f"{PIN}+cu128", "12.8", "cu128"), (PIN, "13.0", "cu130")],
    ids=["cpu", "cu128", "cu130-pypi-wheel"],
)
def test_check_passes_the_requested_build(version: str, cuda: str | None, variant: str) -> None:
    assert torch_build.build_errors(_fake_torch(version, cuda), PIN, variant,
                                    ["filelock", "sympy"]) == []


def test_check_passes_a_cpu_torch_script_run(tmp_path: Path) -> None:
    result = _check(_fake_site(tmp_path, f"{PIN}+cpu"), "--version", PIN, "--variant", "cpu")
    assert result.returncode == 0, result.stderr
    assert "is the cpu build" in result.stdout


def test_check_refuses_an_unknown_variant(tmp_path: Path) -> None:
    result = _check(_fake_site(tmp_path, f"{PIN}+cpu"), "--version", PIN, "--variant", "gpu")
    assert result.returncode == 1
    assert "unknown torch variant 'gpu'" in result.stderr


def test_check_passes_this_environments_cpu_torch() -> None:
    """The real torch of the test environment (in process: torch is loaded here anyway) is the
    pinned CPU build, with the attributes the check reads."""
    import torch

    assert torch_build.build_errors(torch, PIN, "cpu", torch_build.installed_distributions()) == []
    assert torch_build.build_errors(torch, PIN, "cu128", []) != []
