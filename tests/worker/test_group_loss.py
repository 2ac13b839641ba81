"""A TP group loses a rank while idle: the survivor notices through the heartbeats and leaves
with GROUP_LOST_EXIT, so that a restart policy (compose, LWS) can re-form the whole group."""

from __future__ import annotations

import time

import pytest

from procs import PYTHON, ServiceProcesses, free_port
from worker.tiny_models import make_tiny_llama
from worker_service.peer_watch import GROUP_LOST_EXIT

PEER_TIMEOUT_S = 3.0
READY_TIMEOUT_S = 120.0


@pytest.mark.timeout(180)
def test_survivor_of_a_killed_rank_leaves_within_the_peer_timeout(tmp_path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    master_port = free_port()
    with ServiceProcesses() as procs:
        addresses = []
        for rank in range(2):
            port = free_port()
            procs.start(f"worker{rank}", [
                PYTHON, "-m", "worker_service", "--model", str(model), "--port", str(port),
                "--kv-cache-mb", "4", "--num-threads", "1", "--device", "cpu",
                "--peer-timeout-s", str(PEER_TIMEOUT_S),
            ], env={"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(master_port)})
            addresses.append(f"127.0.0.1:{port}")
        for address in addresses:
            procs.wait_healthy(address, timeout_s=READY_TIMEOUT_S)
        time.sleep(PEER_TIMEOUT_S)  # idle and beating: nobody leaves
        assert procs.procs["worker0"].poll() is None
        procs.kill("worker1")
        killed_at = time.monotonic()
        assert procs.procs["worker0"].wait(timeout=PEER_TIMEOUT_S * 3) == GROUP_LOST_EXIT
        assert time.monotonic() - killed_at < PEER_TIMEOUT_S * 2
        assert "leaving the TP group: rank 1" in procs.tail("worker0")
