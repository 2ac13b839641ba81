"""The worker's glibc allocator settings (`worker_service/allocator.py`): a freed temporary of a
few MB stays with the process for the next step instead of going back to the kernel.

Each case runs in a fresh interpreter (the settings are process-wide): allocate and free a
32 MB tensor, and compare the resident size before and after the free."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys
sys.path.insert(0, {root!r})
import torch
from worker_service.allocator import keep_freed_memory

def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

applied = keep_freed_memory() if {apply} else False
x = torch.ones(8 << 20)  # 32 MB, touched
with_it = resident_mb()
del x
after = resident_mb()
print(applied, with_it - after)
"""


def dropped_mb(apply: bool) -> tuple[bool, float]:
    done = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT), apply=apply)],
                          capture_output=True, text=True, timeout=120, check=True)
    applied, dropped = done.stdout.split()
    return applied == "True", float(dropped)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator on Linux")
def test_freed_temporaries_stay_with_the_worker() -> None:
    applied, kept_drop = dropped_mb(True)
    if not applied:
        pytest.skip("not glibc: the settings do not apply")
    _, default_drop = dropped_mb(False)
    assert default_drop > 24  # glibc's default hands a freed 32 MB block back at once
    assert kept_drop < 4  # with the settings it stays for the next step
