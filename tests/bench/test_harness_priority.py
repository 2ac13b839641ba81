"""The stack bench's harness priority: what take_harness_priority says is what the kernel did."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.processes import ROOT, is_realtime

PROBE = ("import os; from bench.processes import take_harness_priority, HARNESS_RT_PRIORITY; "
         "got = take_harness_priority(); policy = os.sched_getscheduler(0); "
         "print(got, policy == os.SCHED_FIFO, os.sched_getparam(0).sched_priority == HARNESS_RT_PRIORITY)")


def test_take_harness_priority_reports_what_the_kernel_granted() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout.split()
    granted, fifo, priority = (word == "True" for word in out)
    assert granted == fifo  # granted exactly when the process runs under SCHED_FIFO
    if granted:
        assert priority


def test_a_process_at_normal_priority_is_not_realtime() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not is_realtime(child.pid)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert not is_realtime(child.pid)  # gone
