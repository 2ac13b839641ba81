"""Run a service module under cProfile; SIGUSR1 writes the profile so far (the services end
with `os._exit`, past any exit hook).

    python -m bench.profiled OUT.prof -m gateway_service --port ...

cProfile sees the main thread only: the event loop, where the services' per-token work runs.
"""

from __future__ import annotations

import cProfile
import runpy
import signal
import sys


def main() -> None:
    out, dash_m, module, *args = sys.argv[1:]
    if dash_m != "-m":
        raise SystemExit("usage: python -m bench.profiled OUT -m MODULE [ARGS...]")
    profiler = cProfile.Profile()

    def dump(signum, frame) -> None:
        profiler.disable()
        profiler.dump_stats(out)
        profiler.enable()

    signal.signal(signal.SIGUSR1, dump)
    sys.argv = [module, *args]
    profiler.enable()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
