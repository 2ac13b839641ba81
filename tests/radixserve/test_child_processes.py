"""The launcher's children die with it, even when it is SIGKILLed (no `preexec_fn` involved)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from procs import ROOT

# A stand-in for the launcher: starts one long sleeper through `Children`, says its pid, waits.
LAUNCHER = textwrap.dedent("""
    import sys, time
    from radixserve.child_processes import Children
    from radixserve.stack_plan import ChildSpec
    children = Children(shutdown_timeout_s=5)
    proc = children.start(ChildSpec("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], ""))
    print(proc.pid, flush=True)
    time.sleep(120)
""")
GONE_WITHIN_S = 10.0


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_child_dies_with_a_killed_launcher() -> None:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], cwd=ROOT, stdout=subprocess.PIPE,
                                text=True, start_new_session=True)
    child = None
    try:
        assert launcher.stdout is not None
        child = int(launcher.stdout.readline())
        # The wrapper execs the command in place: the pid the launcher saw is the sleeper's.
        deadline = time.monotonic() + GONE_WITHIN_S
        while "radixserve.child_processes" in Path(f"/proc/{child}/cmdline").read_text():
            assert time.monotonic() < deadline, "the wrapper never became the command"
            time.sleep(0.05)
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's group only: the child has its own
        launcher.wait(timeout=10)
        deadline = time.monotonic() + GONE_WITHIN_S
        while _alive(child):
            assert time.monotonic() < deadline, "the child outlived its launcher"
            time.sleep(0.05)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=10)
        if child is not None and _alive(child):
            os.killpg(child, signal.SIGKILL)


def test_the_wrapper_refuses_to_start_a_child_whose_launcher_is_gone() -> None:
    not_the_parent = os.getpid() + 1_000_000
    result = subprocess.run(
        [sys.executable, "-m", "radixserve.child_processes", str(not_the_parent), "/bin/echo", "ran"],
        cwd=ROOT, capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 1 and "ran" not in result.stdout
