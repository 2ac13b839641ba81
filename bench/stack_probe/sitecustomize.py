"""Bench-only probe for `bench.stack_token_split`, loaded by every stack process whose
PYTHONPATH starts with this folder (Python imports `sitecustomize` at start-up).

With RADIXSERVE_STACK_PROBE set to a folder it does two things, and nothing otherwise:

- names each Python thread's OS thread after it (`prctl(PR_SET_NAME)`; CPython leaves them all
  named after the process), so /proc/<pid>/task/<tid>/stat splits a process's CPU by thread.
  A thread a native library starts (OpenMP's team, grpc's pollers) inherits its starter's name
  unless the library names it.
- in a worker rank (RANK set, as `radixserve up` sets it for ranks only), times each task on the
  task thread (`WorkerService._run`) and the forward pass inside it (`ModelRunner.forward`), in
  wall and in the task thread's own CPU, and writes the running totals, with the task thread's
  id, to <folder>/<pid>.json every PROBE_WRITE_S.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time

PROBE_DIR = os.environ.get("RADIXSERVE_STACK_PROBE")
PR_SET_NAME = 15
PROBE_WRITE_S = 0.05


def _name_threads() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    bootstrap = threading.Thread._bootstrap_inner

    def named(self: threading.Thread) -> None:
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(self.name.encode()[:15]), 0, 0, 0)
        bootstrap(self)

    threading.Thread._bootstrap_inner = named


def _time_worker(folder: str) -> None:
    from worker_service import model_runner, service

    totals = {"tasks": 0, "task_wall_s": 0.0, "task_cpu_s": 0.0, "forward_wall_s": 0.0,
              "forward_cpu_s": 0.0, "task_tid": 0}

    def timed(fn, prefix: str, count: bool):
        def wrapper(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[f"{prefix}_wall_s"] += time.perf_counter() - wall
                totals[f"{prefix}_cpu_s"] += time.thread_time() - cpu
                if count:
                    totals["tasks"] += 1
                    totals["task_tid"] = threading.get_native_id()
        return wrapper

    service.WorkerService._run = timed(service.WorkerService._run, "task", True)
    model_runner.ModelRunner.forward = timed(model_runner.ModelRunner.forward, "forward", False)
    path = os.path.join(folder, f"{os.getpid()}.json")

    def write() -> None:
        while True:
            time.sleep(PROBE_WRITE_S)
            with open(path + ".tmp", "w") as out:
                json.dump(totals, out)
            os.replace(path + ".tmp", path)

    threading.Thread(target=write, name="probe-writer", daemon=True).start()


if PROBE_DIR:
    _name_threads()
    if "RANK" in os.environ:
        _time_worker(PROBE_DIR)
