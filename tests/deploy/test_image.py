"""The Dockerfile and its build context, checked without a container engine."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from deploy_checks import ROOT
from image_checks import (
    context_files,
    dockerfile_errors,
    dockerignore_patterns,
    parse_dockerfile,
)

DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = ROOT / "pyproject.toml"


def test_dockerfile_passes() -> None:
    assert dockerfile_errors(DOCKERFILE.read_text()) == []


TORCH_INSTALL = """    && pip install --no-deps \\
        --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/${TORCH_VARIANT}}" \\
        "torch==${version}" \\"""
FINAL_CHECK = """    && python -c "import radixserve.v1.generation_pb2_grpc, radixserve.health_probe" \\
    && python /opt/radixserve-build/torch_build.py check \\
        --version "$(cat /opt/radixserve-build/torch-version)" --variant "${TORCH_VARIANT}"\n"""


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("USER ${APP_UID}", "USER root", "non-root"),
        ("ARG APP_UID=10001", "ARG APP_UID=0", "non-root"),
        ("ARG PYTHON_IMAGE=python:3.11-slim", "ARG PYTHON_IMAGE=python:3.11", "base image"),
        ("RUN python -m radixserve.gen_protos \\\n    && pip install --no-deps . \\",
         "RUN pip install --no-deps . \\\n    && python -m radixserve.gen_protos \\", "protos"),
        ('CMD ["radixserve", "up"', 'CMD ["python", "-m", "http.server"', "no radixserve service"),
        # Defect 1: a frontend fetched from Docker Hub, or syntax the classic builder lacks.
        ("# One image", "# syntax=docker/dockerfile:1\n# One image", "syntax"),
        ("RUN version=", "RUN --mount=type=cache,target=/root/.cache/pip version=", "--mount"),
        ("COPY pyproject.toml ./", "COPY --link pyproject.toml ./", "--link"),
        ("COPY pyproject.toml ./", "COPY --chmod=0644 pyproject.toml ./", "--chmod"),
        ("RUN useradd", "RUN <<EOF\nuseradd\nEOF\nRUN useradd", "heredoc"),
        # Defect 3: the version written twice, a fallback index, no check after the installs.
        ("ARG TORCH_VARIANT=cpu", "ARG TORCH_VARIANT=cpu\nARG TORCH_VERSION=2.13.0", "twice"),
        ('"torch==${version}" \\', '"torch==2.13.0" \\', "written in the Dockerfile"),
        ("RUN python /pin/torch_build.py pin /pin/pyproject.toml",
         "RUN echo 2.13.0", "reads the torch version"),
        ("    && pip install --no-deps \\\n",
         "    && pip install --no-deps --extra-index-url https://pypi.org/simple \\\n",
         "--extra-index-url"),
        (TORCH_INSTALL, TORCH_INSTALL.replace('--index-url "${TORCH_INDEX_URL:-https://download'
                                              '.pytorch.org/whl/${TORCH_VARIANT}}" ', ""),
         "torch index"),
        (FINAL_CHECK, FINAL_CHECK.split(" \\\n    && python /opt")[0] + "\n", "not checked"),
    ],
    ids=["root-user", "root-uid", "base-image", "protos-order", "command", "syntax-directive",
         "run-mount", "copy-link", "copy-chmod", "heredoc", "torch-version-arg",
         "torch-version-literal", "torch-pin-not-read", "extra-index", "no-torch-index",
         "no-final-check"],
)
def test_dockerfile_check_rejects_broken_copies(old: str, new: str, message: str) -> None:
    text = DOCKERFILE.read_text()
    assert old in text, f"the Dockerfile no longer contains {old!r}: update this test"
    errors = dockerfile_errors(text.replace(old, new, 1))
    assert any(message in error for error in errors), errors


def test_requirements_step_reads_pyproject() -> None:
    """Run the Dockerfile's own requirements one-liner against pyproject.toml."""
    run = next(i.text for i in parse_dockerfile(DOCKERFILE.read_text())
               if i.keyword == "RUN" and "tomllib" in i.text)
    words = shlex.split(run)
    code = words[words.index("-c") + 1]
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=30, check=True).stdout.split()
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert out == project["dependencies"] + project["optional-dependencies"]["model"]
    assert "torch==2.13.0" in out and any(line.startswith("gguf") for line in out)


def _context(ignore_text: str) -> set[str]:
    return context_files(ROOT, dockerignore_patterns(ignore_text))


def test_build_context_has_the_sources_and_nothing_heavy() -> None:
    files = _context((ROOT / ".dockerignore").read_text())
    assert "pyproject.toml" in files
    for proto in ("generation", "router", "worker"):
        assert f"protos/radixserve/v1/{proto}.proto" in files
    for package in ("radixserve", "worker_service", "router_service", "gateway_service"):
        assert f"{package}/__init__.py" in files
    assert "radixserve/gen_protos.py" in files and "radixserve/health_probe.py" in files
    for ins in parse_dockerfile(DOCKERFILE.read_text()):
        if ins.keyword == "COPY" and not ins.text.startswith("--from="):
            sources = [s for s in ins.text.split()[:-1] if s != "."]
            assert set(sources) <= files, f"COPY {ins.text}: not in the build context"
    assert "deploy/image/torch_build.py" in files
    for left_out in (".venv/", "models/", ".git/", ".cache/", "radixserve/v1/", "tests/",
                     "deploy/k8s/", "deploy/README.md", "deploy/image/__pycache__/"):
        assert not any(f.startswith(left_out) for f in files), left_out
    assert not any("__pycache__" in f or f.endswith(".pyc") for f in files)


def test_build_context_check_sees_a_broken_dockerignore(tmp_path: Path) -> None:
    for name in (".venv/bin/python", "protos/radixserve/v1/worker.proto",
                 "radixserve/__pycache__/flags.cpython-311.pyc", "models/m/model.safetensors",
                 "radixserve/flags.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    ignore = dockerignore_patterns((ROOT / ".dockerignore").read_text())
    assert context_files(tmp_path, ignore) == {"protos/radixserve/v1/worker.proto",
                                               "radixserve/flags.py"}
    assert "protos/radixserve/v1/worker.proto" not in context_files(tmp_path, ignore + ["protos"])
    without_venv = [p for p in ignore if p != ".venv"]
    assert ".venv/bin/python" in context_files(tmp_path, without_venv)
    without_pyc = [p for p in ignore if "pyc" not in p and "pycache" not in p]
    assert "radixserve/__pycache__/flags.cpython-311.pyc" in context_files(tmp_path, without_pyc)


@pytest.mark.timeout(120)
def test_build_steps_work_from_the_context(tmp_path: Path) -> None:
    """The Dockerfile's project steps, run on exactly the files the build context holds:
    generate the protobuf code, install the project, import the services from the install."""
    pytest.importorskip("setuptools")
    context, target = tmp_path / "context", tmp_path / "site"
    for name in context_files(ROOT, dockerignore_patterns((ROOT / ".dockerignore").read_text())):
        (context / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, context / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "radixserve.gen_protos"], cwd=context, env=env,
                   check=True, capture_output=True, timeout=60)
    # No build isolation: the test must not need the network (the real build fetches setuptools).
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--target", str(target), "."],
                   cwd=context, env=env, check=True, capture_output=True, timeout=90)
    code = ("import radixserve, radixserve.v1.worker_pb2_grpc, radixserve.health_probe, "
            "worker_service, router_service, gateway_service; print(radixserve.__file__)")
    shown = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                           env=env | {"PYTHONPATH": str(target)}, check=True,
                           capture_output=True, text=True, timeout=60).stdout
    assert Path(shown.strip()).is_relative_to(target)
    assert (target / "bin" / "radixserve").is_file()  # the `radixserve up` console script


def test_default_command_is_a_valid_launcher_call() -> None:
    """The image's default CMD (`radixserve up ...`) parses with the launcher's own flags and
    serves the gateway on every interface with the model from the /models volume."""
    launcher_config = pytest.importorskip("radixserve.launcher_config")
    stack_plan = pytest.importorskip("radixserve.stack_plan")
    cmd = next(i.text for i in reversed(parse_dockerfile(DOCKERFILE.read_text()))
               if i.keyword == "CMD")
    words = json.loads(cmd)
    assert words[0] == "radixserve"
    args = launcher_config.config_from_args(words[1:])
    plan = stack_plan.plan_stack(args)
    gateway = plan.groups[-1][0].cmd
    assert gateway[gateway.index("--host") + 1] == "0.0.0.0"
    assert gateway[gateway.index("--model") + 1] == "/models/smollm2-135m-instruct"
