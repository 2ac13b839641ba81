"""A router's or a worker's port is its own: a second server on a port something listens on
fails to start, where gRPC's default (SO_REUSEPORT) would let it take half the connections.
Gateways, which share their port on purpose (`--gateways N`), still can."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from procs import ROOT

from radixserve.metrics import CannotListen
from radixserve.serving import start_server

SERVICE = "radixserve.v1.Probed"


async def _second_on_the_same_port(share_port: bool) -> None:
    first, _, port = await start_server("127.0.0.1", 0, [], [SERVICE], share_port=share_port)
    try:
        second, _, again = await start_server("127.0.0.1", port, [], [SERVICE], share_port=share_port)
        await second.stop(grace=None)
        assert again == port
    finally:
        await first.stop(grace=None)


@pytest.mark.timeout(30)
def test_a_port_already_listened_on_is_refused() -> None:
    with pytest.raises(CannotListen, match=r"cannot listen on 127\.0\.0\.1:\d+ \(is another process listening there\?\)"):
        asyncio.run(_second_on_the_same_port(share_port=False))


@pytest.mark.timeout(30)
def test_gateways_may_share_their_port() -> None:
    asyncio.run(_second_on_the_same_port(share_port=True))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag, said", [("--port", "cannot listen on 127.0.0.1:{port} (is another process"),
                                        ("--metrics-port", "cannot serve /metrics on 127.0.0.1:{port}: ")])
def test_a_router_on_a_taken_port_stops_with_one_line(flag, said) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--port", "0", "--metrics-port", "0", flag, str(port), "--workers", "127.0.0.1:1"]
        done = subprocess.run([sys.executable, "-m", "router_service", *args], capture_output=True, text=True,
                              timeout=50, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"python -m router_service: {said.format(port=port)}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_a_gateway_on_a_port_held_without_sharing_stops_with_one_line(flag, smollm2_dir) -> None:
    """A gateway listens on its shared ports only once it has loaded, but whether it can is
    checked first: a port something holds without SO_REUSEPORT is the one line, as a router's."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--port", "0", "--http-port", "0", "--metrics-port", "0", flag, str(port),
                "--routers", "127.0.0.1:1", "--model", str(smollm2_dir)]
        done = subprocess.run([sys.executable, "-m", "gateway_service", *args], capture_output=True, text=True,
                              timeout=50, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "tokenizer loaded" not in done.stderr, done.stderr  # said before the loading, not after it
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"python -m gateway_service: cannot listen on 127.0.0.1:{port} (Address already in use)"), done.stderr
