"""Client tests run against the in-process gateway with fake routers (tests/gateway/harness.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.harness import GatewayHarness, start_harness, stop_harness
from gateway_service.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def client_tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.load(smollm2_dir)


@pytest.fixture(scope="module")
def gateway_harness(client_tokenizer) -> Iterator[GatewayHarness]:
    running = start_harness(client_tokenizer)
    try:
        yield running
    finally:
        stop_harness(running)


@pytest.fixture
def harness(gateway_harness) -> GatewayHarness:
    gateway_harness.script_all([])
    gateway_harness.reprobe()
    return gateway_harness
