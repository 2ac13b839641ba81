"""A real gateway process (`python -m gateway_service`) in front of an in-process fake router,
on 127.0.0.1, for tests that need what only a process shows: its RSS, its signals, its sockets."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gateway.background import BackgroundLoop
from gateway.fake_router import FakeRouter
from gateway.harness import server_info
from procs import ServiceProcesses, free_port

HEALTHY_WITHIN_S = 90


@dataclass
class GatewayProcess:
    procs: ServiceProcesses
    router: FakeRouter
    loop: BackgroundLoop
    grpc_port: int
    http_port: int

    @property
    def pid(self) -> int:
        return self.procs.procs["gateway"].pid

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.procs.tail("gateway", 1_000_000)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@contextlib.contextmanager
def gateway_process(model_dir: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[GatewayProcess]:
    """The gateway with its HTTP API on a free port; `flags` are added to its command line."""
    loop = BackgroundLoop()
    router = FakeRouter(server_info())
    loop.run(router.start())
    grpc_port, http_port = free_port(), free_port()
    try:
        with ServiceProcesses() as procs:
            procs.start("gateway", [
                sys.executable, "-m", "gateway_service", "--port", str(grpc_port), "--model", str(model_dir),
                "--routers", router.address, *flags,
            ], env={"RADIXSERVE_HTTP_PORT": str(http_port), **(env or {})})
            procs.wait_healthy(f"127.0.0.1:{grpc_port}", timeout_s=HEALTHY_WITHIN_S)
            yield GatewayProcess(procs, router, loop, grpc_port, http_port)
    finally:
        loop.run(router.stop())
        loop.close()
