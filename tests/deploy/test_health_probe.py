"""The compose health check: `python -m radixserve.health_probe` against the shared server plumbing."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from radixserve.health_probe import probe
from radixserve.serving import start_server
from procs import ROOT


async def _run_probe(*args: str, env: dict[str, str] | None = None) -> int:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "radixserve.health_probe", *args, env=full_env, cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    return await asyncio.wait_for(proc.wait(), timeout=30)


async def _scenario() -> None:
    server, health, port = await start_server("127.0.0.1", 0, [], ["radixserve.v1.Probed"])
    address = f"127.0.0.1:{port}"
    try:
        # Services start NOT_SERVING: the probe must fail until they say they are ready.
        assert await asyncio.to_thread(probe, address) == "NOT_SERVING"
        assert await _run_probe("--address", address) == 1
        await health.set(True)
        assert await asyncio.to_thread(probe, address) == "SERVING"
        assert await _run_probe("--address", address) == 0
        assert await _run_probe("--address", address, "--service", "radixserve.v1.Probed") == 0
        assert await _run_probe("--address", address, "--service", "no.such.Service") == 1
        # Without --address the probe checks 127.0.0.1:$RADIXSERVE_PORT, as compose uses it.
        assert await _run_probe(env={"RADIXSERVE_PORT": str(port)}) == 0
    finally:
        await server.stop(grace=None)
    # Nothing listening any more: unreachable counts as unhealthy, within the deadline.
    assert (await asyncio.to_thread(probe, address, "", 1.0)).startswith("UNREACHABLE")
    assert await _run_probe("--address", address, "--timeout-s", "1") == 1


@pytest.mark.timeout(60)
def test_probe_follows_server_health() -> None:
    asyncio.run(_scenario())


def test_probe_needs_an_address() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RADIXSERVE_PORT"}
    assert asyncio.run(_run_probe(env=env | {"RADIXSERVE_PORT": ""})) == 2
