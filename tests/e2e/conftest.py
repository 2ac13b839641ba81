"""End-to-end fixtures: transformers' greedy outputs, computed once per session."""

from __future__ import annotations

import pytest

from e2e.reference import Reference, greedy_references


@pytest.fixture(scope="session")
def references(smollm2_dir) -> list[Reference]:
    return greedy_references(smollm2_dir)
