"""A rank notices a silent peer and a lost store, even with no task running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from procs import ROOT, free_port
from worker_service.peer_watch import PeerWatch

TIMEOUT_S = 1.0


def watch(port: int, rank: int, lost: list[str], done: threading.Event) -> PeerWatch:
    def on_lost(reason: str) -> None:
        lost.append(reason)
        done.set()

    return PeerWatch("127.0.0.1", port, rank, 2, TIMEOUT_S, on_lost=on_lost)


@pytest.mark.timeout(30)
def test_beating_peers_stay_and_a_silent_one_is_lost_within_the_timeout() -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=5),
                          wait_for_workers=False)
    lost0, lost1 = [], []
    done0, done1 = threading.Event(), threading.Event()
    rank0, rank1 = watch(port, 0, lost0, done0), watch(port, 1, lost1, done1)
    rank0.start()
    rank1.start()
    assert not done0.wait(3 * TIMEOUT_S) and not done1.is_set()  # both beat: nobody leaves
    rank1.stop()  # rank 1 goes silent (as if frozen)
    stopped_at = time.monotonic()
    assert done0.wait(5 * TIMEOUT_S)
    assert "rank 1" in lost0[0]
    assert time.monotonic() - stopped_at < 3 * TIMEOUT_S
    assert not lost1
    del store


@pytest.mark.timeout(30)
def test_a_lost_store_means_rank_0_is_gone() -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=5),
                          wait_for_workers=False)
    lost0, lost, done0, done = [], [], threading.Event(), threading.Event()
    rank0, rank1 = watch(port, 0, lost0, done0), watch(port, 1, lost, done)
    rank0.start()
    rank1.start()
    assert not done.wait(2 * TIMEOUT_S)
    del store  # the master store closes, as when rank 0's process dies
    assert done.wait(5 * TIMEOUT_S)
    assert lost[0].startswith("the group's store"), lost


# Rank 0: hosts the store and beats like a rank does.
_STORE_HOST = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from worker_service.peer_watch import PeerWatch
port, timeout_s = int(sys.argv[1]), float(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), wait_for_workers=False)
PeerWatch("127.0.0.1", port, 0, 2, timeout_s, on_lost=print).start()
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_a_frozen_store_host_is_lost_within_the_timeout() -> None:
    """SIGSTOP on the process hosting the store (rank 0): store calls hang forever then, so the
    heartbeat's watchdog, not the store call, must notice."""
    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", _STORE_HOST, str(port), str(TIMEOUT_S)],
                            stdout=subprocess.PIPE, start_new_session=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert host.stdout.readline() == b"ready\n"
        lost, done = [], threading.Event()
        rank1 = watch(port, 1, lost, done)
        rank1.start()
        assert not done.wait(2 * TIMEOUT_S)  # the store answers: nothing lost
        os.kill(host.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        assert done.wait(5 * TIMEOUT_S)
        assert time.monotonic() - frozen_at < 2.5 * TIMEOUT_S
        assert lost[0].startswith("the group's store") and "not answered" in lost[0], lost
        assert len(lost) == 1
        rank1.stop()
    finally:
        host.kill()
        host.wait()
