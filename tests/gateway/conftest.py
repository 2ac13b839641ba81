"""Fixtures for gateway tests: the real tokenizer, and an in-process gateway with fake routers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.harness import GatewayHarness, running_harness
from gateway_service.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.load(smollm2_dir)


@pytest.fixture(scope="module")
def harness(tokenizer) -> Iterator[GatewayHarness]:
    with running_harness(tokenizer) as running:
        yield running


@pytest.fixture(autouse=True)
def _reset_routers(request) -> None:
    """Each test starts from healthy, freshly scripted routers."""
    if "harness" in request.fixturenames:
        running = request.getfixturevalue("harness")
        running.script_all([])
        running.reprobe()
