"""The router never runs a model: importing it must not load torch or transformers, and its core
(every module in router_service/core/) must not load grpc either (DESIGN.md, STYLE.md rule 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import router_service.core

CHECK = """
import sys
import {modules}
loaded = sorted(name for name in {forbidden} if name in sys.modules)
print(",".join(loaded))
"""


def _loaded(modules: list[str], forbidden: list[str]) -> list[str]:
    code = CHECK.format(modules=", ".join(modules), forbidden=forbidden)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [name for name in done.stdout.strip().split(",") if name]


@pytest.mark.timeout(120)
def test_router_service_loads_no_model_code() -> None:
    modules = ["router_service.__main__", "router_service.engine", "router_service.service"]
    assert _loaded(modules, ["torch", "transformers"]) == []


def core_modules() -> list[str]:
    """Every module in the router core's folder, found by walking it (a new file is covered)."""
    core = Path(router_service.core.__file__).parent
    return sorted(
        "router_service.core" + ("" if path.stem == "__init__" else f".{path.stem}")
        for path in core.glob("*.py")
    )


def test_the_core_folder_holds_the_core() -> None:
    names = set(core_modules())
    for concept in ("radix_cache", "page_allocator", "page_manager", "scheduler", "step_builder",
                    "lifecycle", "admission", "speculation", "request", "step_plan"):
        assert f"router_service.core.{concept}" in names


@pytest.mark.timeout(120)
def test_router_core_is_plain_python() -> None:
    assert _loaded(core_modules(), ["torch", "transformers", "grpc"]) == []
