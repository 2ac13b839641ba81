"""SIGKILL the worker rank in this container, as a crash would end it.

    python kill_rank.py [MODULE]        (MODULE: worker_service)

`make compose-test` pipes this file into a worker container (`python - < kill_rank.py`). The
container's PID 1 is its init (tini), which cannot be killed from inside; the rank is the
process started as `python -m MODULE`, found through /proc. When it dies, init exits with it
and the container stops on its own, so its restart policy applies (a `docker kill` or
`docker stop` would count as stopped by hand and skip the policy).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

DEFAULT_MODULE = "worker_service"


def processes_running(module: str) -> list[int]:
    """Pids whose command line is `<python> -m module ...`, other than this process."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # it ended meanwhile
            continue
        if argv[1:3] == [b"-m", module.encode()]:
            found.append(int(entry.name))
    return found


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    module = args[0] if args else DEFAULT_MODULE
    pids = processes_running(module)
    if not pids:
        print(f"kill_rank: no `python -m {module}` process here", file=sys.stderr)
        return 1
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    print(f"kill_rank: sent SIGKILL to {module} (pid {', '.join(map(str, pids))})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
