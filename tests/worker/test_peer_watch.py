"""A rank notices a silent peer and a lost store, even with no task running."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from procs import free_port
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
