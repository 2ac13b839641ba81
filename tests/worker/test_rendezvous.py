"""The TP group's rendezvous store listens on MASTER_ADDR only, not on every interface."""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path

from procs import free_port
from worker_service.distributed import rendezvous_store

LISTEN_STATE = "0A"  # TCP_LISTEN in /proc/net/tcp


def listening_addresses(port: int) -> list[str]:
    """Local IPv4 addresses listening on `port`, from /proc/net/tcp."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        address, hex_port = fields[1].split(":")
        if int(hex_port, 16) == port and fields[3] == LISTEN_STATE:
            found.append(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def test_rank0_store_listens_on_master_addr_only():
    port = free_port()
    store = rendezvous_store(0, 1, "127.0.0.1", port, timedelta(seconds=10))
    try:
        store.set("probe", "ok")
        assert store.get("probe") == b"ok"
        assert listening_addresses(port) == ["127.0.0.1"]  # not 0.0.0.0
    finally:
        del store
