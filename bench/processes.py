"""Service processes for benchmarks: started in their own sessions, killed (whole group) when
the bench ends, waited for with a deadline, and their CPU time read from /proc."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from radixserve.health import check_health

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 300.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class Processes:
    """Child processes in their own sessions, killed (whole group) when the bench ends."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs[name] = proc
        return proc

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def wait_serving(address: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not await check_health(address, timeout_s=1.0):
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{address} not serving after {READY_TIMEOUT_S}s")
        await asyncio.sleep(0.2)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


# The stack bench's fake worker group asks for this real-time priority: it stands for a GPU,
# whose steps do not wait for this machine's cores. Without it the fake's timer and reads wait
# behind the stack's processes on a small machine, and that wait is counted as the stack's (see
# bench.stack_bench).
HARNESS_RT_PRIORITY = 5


def take_harness_priority() -> bool:
    """Run this process (and the threads it starts after) under SCHED_FIFO at
    `HARNESS_RT_PRIORITY`; False, and the process unchanged, where that is not permitted."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(HARNESS_RT_PRIORITY))
    except (PermissionError, OSError, AttributeError):
        return False
    return True


def is_realtime(pid: int) -> bool:
    try:
        return os.sched_getscheduler(pid) == os.SCHED_FIFO
    except (ProcessLookupError, OSError):
        return False
