"""Noticing a lost or frozen peer rank, even while idle, and leaving the group.

A TP group is only useful whole: once a peer is gone, every later collective blocks or fails,
and a restarted peer cannot rejoin a group whose other members are still in the old one. So a
rank that loses a peer leaves, exiting non-zero, and the restart policy (launcher, compose,
LWS group recreate) brings the whole group back.

Each rank bumps its own counter in the group's TCP store (rank 0 hosts it) every
`timeout_s / BEATS_PER_TIMEOUT`, on a thread of its own, independent of the task thread (which
may sit in a collective that never returns). A peer whose counter has not moved for
`timeout_s` is lost (dead or frozen); a store that stops answering means rank 0 is lost.

A store call cannot be trusted to return: against a frozen rank 0 (SIGSTOP) the kernel still
accepts the connection and the request, and torch's `TCPStore.add` waits for the answer forever,
whatever its timeout. So a second thread, which never touches the store, watches the beat
thread: a beat round that has not completed for `timeout_s` means the store (rank 0) is lost.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)

BEATS_PER_TIMEOUT = 4
KEY_PREFIX = "radixserve/beat/"
# The exit status of a rank that left its group because of a peer (not a bug of its own).
GROUP_LOST_EXIT = 3


def leave_group(reason: str) -> None:
    """Exit the process at once with `GROUP_LOST_EXIT`.

    `os._exit`, not `sys.exit`: another thread may be blocked in a collective that will never
    return, and an orderly interpreter shutdown would wait for it forever (or abort).
    """
    log.critical("leaving the TP group: %s; exiting with %d so that the group is restarted",
                 reason, GROUP_LOST_EXIT)
    logging.shutdown()
    os._exit(GROUP_LOST_EXIT)


class PeerWatch:
    """The heartbeat thread of one rank; `start` once the group has formed."""

    def __init__(
        self, master_addr: str, master_port: int, rank: int, world_size: int, timeout_s: float,
        on_lost=leave_group,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._on_lost = on_lost
        self._address = (master_addr, master_port)
        self._stop = threading.Event()
        self._lost = threading.Lock()  # `on_lost` runs once, from whichever thread saw it first
        self._lost_reported = False
        self._last_round = time.monotonic()  # when the beat thread last finished a round
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)
        self._watchdog = threading.Thread(target=self._watch_beats, name="peer-watchdog",
                                          daemon=True)

    def start(self) -> None:
        self._last_round = time.monotonic()
        self._thread.start()
        self._watchdog.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            store = dist.TCPStore(
                *self._address, is_master=False, timeout=timedelta(seconds=self.timeout_s)
            )
            self._beat(store)
        except Exception as exc:  # the store (rank 0) is gone or frozen
            self._report(f"{self._store_name()} stopped answering ({exc})")

    def _store_name(self) -> str:
        return f"the group's store at {self._address[0]}:{self._address[1]}"

    def _report(self, reason: str) -> None:
        with self._lost:
            if self._stop.is_set() or self._lost_reported:
                return
            self._lost_reported = True
        self._on_lost(reason)

    def _watch_beats(self) -> None:
        """Report the store lost when a beat round (connect, or add) hangs past `timeout_s`."""
        while not self._stop.wait(self.timeout_s / BEATS_PER_TIMEOUT):
            stalled = time.monotonic() - self._last_round
            if stalled > self.timeout_s:
                self._report(f"{self._store_name()} has not answered for {stalled:.1f}s "
                             "(rank 0 frozen or unreachable)")
                return

    def _beat(self, store: dist.TCPStore) -> None:
        peers = [rank for rank in range(self.world_size) if rank != self.rank]
        last_count = dict.fromkeys(peers, -1)
        last_change = dict.fromkeys(peers, time.monotonic())
        interval = self.timeout_s / BEATS_PER_TIMEOUT
        self._last_round = time.monotonic()
        while not self._stop.wait(interval):
            store.add(f"{KEY_PREFIX}{self.rank}", 1)
            now = time.monotonic()
            for peer in peers:
                count = store.add(f"{KEY_PREFIX}{peer}", 0)  # reads without waiting for the key
                if count != last_count[peer]:
                    last_count[peer], last_change[peer] = count, now
                elif now - last_change[peer] > self.timeout_s:
                    self._report(f"rank {peer} has not answered for {self.timeout_s:g}s")
                    return
            self._last_round = time.monotonic()
