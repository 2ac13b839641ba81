"""Start real service processes for tests: bounded waits, and nothing left behind.

Usage:
    with ServiceProcesses() as procs:
        procs.start("worker0", [sys.executable, "-m", "worker_service", ...], env={...})
        procs.wait_healthy("127.0.0.1:50060", timeout_s=120)
        ...
Every process is started in its own process group and killed (SIGTERM, then SIGKILL) on exit,
whether the test passed or failed. Each process's output goes to a log file whose tail is
included in the error when a process dies or never becomes healthy.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _port_slice() -> range:
    """The ports this test process hands out: below the kernel's ephemeral range (outgoing
    connections take their source ports from it, so a port picked there can be taken between
    the test checking it and the service binding it) and, under pytest-xdist, a slice of its
    own, so two test processes never hand out the same port."""
    low, high = 10000, min(_ephemeral_range()[0], 65536)
    if high - low < 2000:  # the ephemeral range reaches down: use the ports above it
        low, high = _ephemeral_range()[1] + 1, 65536
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % workers
    size = (high - low) // workers
    return range(low + index * size, low + (index + 1) * size)


_PORTS = _port_slice()
_next_port = _PORTS.start + (os.getpid() * 7919) % len(_PORTS)


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_ports(offsets: tuple[int, ...] = (0,)) -> int:
    """A port P such that P + each offset is free on 127.0.0.1 right now and was never handed
    out before by this process (until its slice wraps): a service started on it is not raced
    by another test's service, nor by a client's source port."""
    global _next_port
    span = max(offsets) + 1
    for _ in range(len(_PORTS)):
        port = _next_port
        if port + span > _PORTS.stop:
            port = _PORTS.start
        _next_port = port + span
        if all(_is_free(port + offset) for offset in offsets):
            return port
    raise RuntimeError(f"no free ports in {_PORTS}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (see free_ports)."""
    return free_ports()


def is_serving(
    address: str, timeout_s: float = 1.0, credentials: grpc.ChannelCredentials | None = None
) -> bool:
    """Health over TLS when `credentials` are given."""
    channel = (
        grpc.insecure_channel(address) if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


class ServiceProcesses:
    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self._logdir = Path(tempfile.mkdtemp(prefix="radixserve-test-"))

    def __enter__(self) -> "ServiceProcesses":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        # One torch thread per service process unless the caller says otherwise: tests start
        # several processes on a 2-core machine, and oversubscribed threads slow them tenfold.
        # HTTP and metrics ports off unless the test asks: fixed defaults would collide.
        # The repository first, then whatever the caller's own path adds (packages installed beside).
        python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        full_env = {**os.environ, "PYTHONPATH": python_path, "PYTHONUNBUFFERED": "1",
                    "OMP_NUM_THREADS": "1", "RADIXSERVE_HTTP_PORT": "0", "RADIXSERVE_METRICS_PORT": "0"}
        full_env.update(env or {})
        log = self._logdir / f"{name}.log"
        self.logs[name] = log
        handle = open(log, "wb")
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=full_env, stdout=handle, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        handle.close()
        self.procs[name] = proc
        return proc

    def tail(self, name: str, num_chars: int = 4000) -> str:
        path = self.logs.get(name)
        if path is None or not path.exists():
            return ""
        return path.read_text(errors="replace")[-num_chars:]

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.tail(name)}")

    def wait_healthy(
        self, address: str, timeout_s: float = 120.0,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            if is_serving(address, credentials=credentials):
                return
            time.sleep(0.2)
        logs = "\n".join(f"--- {n} ---\n{self.tail(n)}" for n in self.procs)
        raise TimeoutError(f"{address} not SERVING after {timeout_s}s\n{logs}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=30)

    def stop(self, name: str, timeout_s: float = 10.0) -> None:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=timeout_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=timeout_s)

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)


PYTHON = sys.executable


def start_worker_ranks(
    procs: ServiceProcesses, model_dir: Path, world_size: int, flags: list[str]
) -> list[str]:
    """Start `world_size` real worker ranks of one TP group on free loopback ports (one
    thread each, CPU); returns their addresses in rank order (not yet waited for)."""
    master_port = free_port()
    addresses = []
    for rank in range(world_size):
        port = free_port()
        procs.start(f"worker{rank}", [
            PYTHON, "-m", "worker_service", "--model", str(model_dir), "--port", str(port),
            "--num-threads", "1", "--device", "cpu", *flags,
        ], env={"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port)})
        addresses.append(f"127.0.0.1:{port}")
    return addresses
