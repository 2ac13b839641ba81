"""Start the whole stack with `radixserve up` (as `python -m radixserve.launcher up`) for tests."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from procs import ServiceProcesses, free_ports
from radixserve.stack_plan import ROUTER_PORT_OFFSET, WORKER_PORT_OFFSET

STARTUP_TIMEOUT_S = 240.0


def free_port_block(tp: int, replicas: int = 1) -> int:
    """A gateway port P whose whole block (P, a router port per replica from P+1, P+9 ...
    P+9+tp*replicas-1) is free right now (procs.free_ports)."""
    return free_ports((0, *(ROUTER_PORT_OFFSET + k for k in range(replicas)),
                       *(WORKER_PORT_OFFSET + r for r in range(tp * replicas))))


@dataclass
class LaunchedStack:
    procs: ServiceProcesses
    port: int
    tp: int
    http_port: int = 0
    metrics_port: int = 0

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def router(self) -> str:
        return f"127.0.0.1:{self.port + ROUTER_PORT_OFFSET}"

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def metrics_url(self, service: str) -> str:
        """`gateway` or `router`: the launcher's metrics port convention."""
        offset = {"gateway": 0, "router": ROUTER_PORT_OFFSET}[service]
        return f"http://127.0.0.1:{self.metrics_port + offset}/metrics"

    @property
    def launcher(self):
        return self.procs.procs["stack"]

    def output(self) -> str:
        return self.procs.tail("stack", 200_000)

    def internal_metadata(self) -> tuple[tuple[str, str], ...]:
        """The `authorization` metadata of this launch's internal token (the launcher prints
        where it wrote it)."""
        path = re.search(r"internal token of this launch: (\S+)", self.output())[1]
        return (("authorization", f"Bearer {Path(path).read_text().strip()}"),)

    def child_pids(self) -> dict[str, int]:
        """From the launcher's "started NAME (pid N)" lines."""
        return {m[0]: int(m[1]) for m in re.findall(r"started (\w+) \(pid (\d+)\)", self.output())}


def launch(
    procs: ServiceProcesses, model_dir: Path, tp: int, default_max_tokens: int = 16,
    env: dict[str, str] | None = None, extra_args: Sequence[str] = (),
    credentials: grpc.ChannelCredentials | None = None,
    with_http: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
    replicas: int = 1,
) -> LaunchedStack:
    """`extra_args` go to `radixserve up`; `credentials` are for its health (TLS stacks);
    `with_http`: also the HTTP API and every /metrics endpoint, on free ports."""
    port = free_port_block(tp, replicas)
    http_port = metrics_port = 0
    if with_http:
        http_port = free_port_block(0)
        metrics_port = free_port_block(tp, replicas)
    procs.start(
        "stack",
        [sys.executable, "-m", "radixserve.launcher", "up", "--model", str(model_dir),
         "--tp", str(tp), "--port", str(port), "--device", device, "--dtype", dtype, "--kv-cache-mb", "64",
         "--shutdown-timeout-s", "20", "--http-port", str(http_port),
         "--metrics-port", str(metrics_port), "--replicas", str(replicas), *extra_args],
        # The launcher passes its environment on: the gateway reads the first; one torch
        # thread per worker, since the test session sets OMP_NUM_THREADS=2 for itself and
        # ranks spinning against each other on two busy cores are many times slower.
        env={"RADIXSERVE_DEFAULT_MAX_TOKENS": str(default_max_tokens), "OMP_NUM_THREADS": "1",
             **(env or {})},
    )
    stack = LaunchedStack(procs, port, tp, http_port, metrics_port)
    procs.wait_healthy(stack.gateway, timeout_s=STARTUP_TIMEOUT_S, credentials=credentials)
    return stack


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    """The pids still alive after waiting up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]
