"""The router never runs a model: importing it must not load torch or transformers, and its core
(cache, allocator, scheduler) must not load grpc either (DESIGN.md, STYLE.md rule 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


@pytest.mark.timeout(120)
def test_router_core_is_plain_python() -> None:
    modules = ["router_service.radix_cache", "router_service.page_allocator", "router_service.scheduler"]
    assert _loaded(modules, ["torch", "transformers", "grpc"]) == []
