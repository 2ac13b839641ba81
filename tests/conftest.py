"""Shared fixtures: the default model folder and loopback ports."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

DEFAULT_MODEL_DIR = ROOT / "models" / "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model, prepared by `make model` (which `make test` runs first)."""
    if not (DEFAULT_MODEL_DIR / "model.safetensors").is_file():
        pytest.fail(f"{DEFAULT_MODEL_DIR} is missing: run `make model` (make test does)")
    return DEFAULT_MODEL_DIR


@pytest.fixture(autouse=True, scope="session")
def _limit_threads() -> None:
    # Two cores on the reference machine: keep test processes from oversubscribing them.
    os.environ.setdefault("OMP_NUM_THREADS", "2")
