"""A TP group loses a rank while idle: the survivor notices through the heartbeats and leaves
with GROUP_LOST_EXIT, so that a restart policy (compose, LWS) can re-form the whole group."""

from __future__ import annotations

import time

import pytest

from procs import ServiceProcesses, start_worker_ranks
from worker.tiny_models import make_tiny_llama
from worker_service.peer_watch import GROUP_LOST_EXIT

PEER_TIMEOUT_S = 3.0
READY_TIMEOUT_S = 120.0


@pytest.mark.timeout(180)
def test_survivor_of_a_killed_rank_leaves_within_the_peer_timeout(tmp_path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    with ServiceProcesses() as procs:
        addresses = start_worker_ranks(procs, model, 2, [
            "--kv-cache-mb", "4", "--peer-timeout-s", str(PEER_TIMEOUT_S),
        ])
        for address in addresses:
            procs.wait_healthy(address, timeout_s=READY_TIMEOUT_S)
        time.sleep(PEER_TIMEOUT_S)  # idle and beating: nobody leaves
        assert procs.procs["worker0"].poll() is None
        procs.kill("worker1")
        killed_at = time.monotonic()
        assert procs.procs["worker0"].wait(timeout=PEER_TIMEOUT_S * 3) == GROUP_LOST_EXIT
        assert time.monotonic() - killed_at < PEER_TIMEOUT_S * 2
        assert "leaving the TP group: rank 1" in procs.tail("worker0")
