"""The whole system at TP=2 (two gloo worker ranks), started with `radixserve up`: greedy
chat output equals transformers', and SIGTERM stops every process (last: ends the stack)."""

from __future__ import annotations

import signal

import pytest

from e2e.parity import check_greedy_parity
from e2e.reference import CHATS
from e2e.stack import launch, wait_gone
from procs import ServiceProcesses


@pytest.fixture(scope="module")
def stack(smollm2_dir):
    with ServiceProcesses() as procs:
        yield launch(procs, smollm2_dir, tp=2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(CHATS)))
def test_greedy_chat_matches_transformers(stack, references, index):
    check_greedy_parity(stack.gateway, index, references[index])


@pytest.mark.timeout(120)
def test_sigterm_stops_every_process(stack):
    """Runs last in this module: it takes the shared stack down."""
    pids = stack.child_pids()
    assert set(pids) == {"worker0", "worker1", "router", "gateway"}
    stack.launcher.send_signal(signal.SIGTERM)
    assert stack.launcher.wait(timeout=60) == 0
    assert "[radixserve] stopped" in stack.output()
    assert wait_gone(list(pids.values())) == []
