"""The launcher's children: started in their own process groups, their output relayed with a
`[name]` prefix, stopped with SIGTERM, a bounded wait, then SIGKILL.

A child must not outlive a launcher that dies without cleaning up (SIGKILL, a crash). Linux's
parent-death signal does that, but it has to be set in the child; `preexec_fn` could do it
between fork and exec, and Python documents that it can deadlock a process with threads (the
launcher has its output relays). So each child starts as

    python -m radixserve.child_processes LAUNCHER_PID COMMAND...

which asks for SIGTERM on its parent's death, exits if that parent is already gone, and then
execs COMMAND in the same process (same pid; the signal setting survives exec).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:  # the exec wrapper below must start fast: no grpc
    from radixserve.stack_plan import ChildSpec

_PR_SET_PDEATHSIG = 1
# Environment that would override the rank settings the launcher hands each worker.
_RANK_ENV = ("RADIXSERVE_RANK", "RADIXSERVE_WORLD_SIZE", "RADIXSERVE_MASTER_ADDR",
             "RADIXSERVE_MASTER_PORT")
# How long `stop` waits for the output relays to see their pipes close.
RELAY_JOIN_TIMEOUT_S = 2.0


class Children:
    """The running children, their prefixed output, and shutdown."""

    def __init__(self, shutdown_timeout_s: float, out: TextIO = sys.stdout) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self._shutdown_timeout_s = shutdown_timeout_s
        self._out = out
        self._out_lock = threading.Lock()
        self._relays: list[threading.Thread] = []

    def say(self, text: str, name: str = "radixserve") -> None:
        with self._out_lock:
            self._out.write(f"[{name}] {text}\n")
            self._out.flush()

    def start(self, spec: ChildSpec) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}
        env.update({"PYTHONUNBUFFERED": "1", **spec.env})
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(os.getpid()), *spec.cmd], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs[spec.name] = proc
        relay = threading.Thread(target=self._relay, args=(spec.name, proc), daemon=True)
        relay.start()
        self._relays.append(relay)
        return proc

    def _relay(self, name: str, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            self.say(raw.decode(errors="replace").rstrip("\n"), name)

    def dead_child(self) -> tuple[str, int] | None:
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return name, code
        return None

    def stop(self, names: list[str] | None = None) -> None:
        """SIGTERM the children named (default: all, the last started first), wait, SIGKILL
        what is left."""
        children = [(name, proc) for name, proc in self.procs.items()
                    if names is None or name in names]
        for _, proc in reversed(children):
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + self._shutdown_timeout_s
        for name, proc in children:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                self.say(f"{name} did not exit after SIGTERM; killing it")
        for _, proc in children:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        if names is None:
            for relay in self._relays:
                relay.join(timeout=RELAY_JOIN_TIMEOUT_S)

    def kill(self, names: list[str]) -> None:
        """SIGKILL the children named, at once, and reap them."""
        for name, proc in self.procs.items():
            if name in names and proc.poll() is None:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def exec_with_parent(parent_pid: int, cmd: list[str]) -> None:
    """In the child: SIGTERM when `parent_pid` dies, then become `cmd`."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own shutdown path still applies
    if os.getppid() != parent_pid:
        sys.exit(1)  # the launcher died before the signal was set: nobody to serve
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    exec_with_parent(int(sys.argv[1]), sys.argv[2:])
