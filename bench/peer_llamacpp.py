"""The llama.cpp peer: the same workloads through llama.cpp's `llama-server` on the same GGUF file.

`make bench` builds `llama-server` from the llama.cpp that the `llama-cpp-python` sdist vendors
(`bench/build_llamacpp.sh`, into the ignored `.peers/llamacpp`). The server rather than the
`llama-cpp-python` binding, because the server is how llama.cpp serves many users: it decodes
`--parallel` slots in one batch (continuous batching) and keeps each slot's prompt so a request
sharing a prefix with the slot's last one reuses its KV (`cache_prompt`), where the binding runs
one sequence at a time. With one slot per concurrent request it is llama.cpp's best on the
32-request shared-prefix workload, as vLLM's engine is vLLM's.

Requests go to its OpenAI-compatible `/v1/chat/completions` through the same HTTP client as
radixserve's HTTP runs (`bench.loadgen_http`: greedy, `ignore_eos`, streamed with usage); the
server renders the file's own chat template (`--jinja`). The server is started in its own
session with its log in a temporary folder, waited for on `/health` with a deadline, and
killed (its whole group) when the jobs end or fail.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench import workloads as wl
from bench.loadgen_http import run_workload_http
from bench.processes import Processes, free_port
from bench.records import summarize

HEALTH_POLL_S = 0.5
LOG_TAIL_CHARS = 2000
WARMUP_MAX_TOKENS = 4


def server_command(binary: Path, gguf: Path, port: int, slots: int, slot_context: int, threads: int) -> list[str]:
    """`llama-server` serving `gguf` on 127.0.0.1:`port` with `slots` parallel slots of
    `slot_context` tokens each, on `threads` threads. Each slot keeps its own KV stream (no
    `--kv-unified`): in one unified buffer every token's attention spans every slot's cells,
    which handicaps llama.cpp on many concurrent requests (docs/quantization.md has the figures)."""
    return [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(slots), "--ctx-size", str(slots * slot_context), "--no-kv-unified",
            "--threads", str(threads), "--threads-batch", str(threads), "--jinja", "--no-webui"]


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Return once `GET /health` answers 200 (the model is loaded); raise if the server exits or
    `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(HEALTH_POLL_S)
    raise TimeoutError(f"llama-server not ready after {timeout_s:.0f} s")


class LlamaServerFailed(RuntimeError):
    """llama-server did not start or failed a request; the message ends with its log's tail."""


def run_job(base_url: str, model: str, workload: wl.Workload, concurrency: int, time_limit_s: float,
            label: str = "llama.cpp") -> dict:
    """One job through the server at `base_url` (its `/v1`): the job's summary; raises if a request failed."""
    records, wall_s = asyncio.run(run_workload_http(base_url, model, workload, concurrency, time_limit_s))
    summary = summarize(records, wall_s)
    errors = [r.error for r in records if r.error]
    if errors:
        raise LlamaServerFailed(f"llama-server failed {len(errors)} requests, e.g. {errors[0]}")
    print(f"[{label}] {workload.name} c={concurrency}: {summary['output_tokens_per_s']} out tok/s, "
          f"ttft p50 {summary['ttft_p50_ms']} ms, itl p50 {summary['itl_p50_ms']} ms, "
          f"hit rate {summary['cache_hit_rate']}", flush=True)
    return {"workload": workload.name, "concurrency": concurrency, **summary}


@contextmanager
def llamacpp_server(binary: Path, gguf: Path, slots: int, time_limit_s: float,
                    threads: int = os.cpu_count() or 1, slot_context: int = 2048,
                    startup_timeout_s: float = 300.0) -> Iterator[tuple[str, list[str]]]:
    """`llama-server` on `gguf` (module doc), healthy and warmed by one short request (as radixserve
    gets one): its `/v1` URL and command; killed, its whole group, on leaving. A failure to start
    or a failed request inside the block raises `LlamaServerFailed` with the log's tail."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = Processes(Path(tmp))
        port = free_port()
        cmd = server_command(binary, gguf, port, slots, slot_context, threads)
        print(f"[bench] starting: {' '.join(cmd)}", flush=True)
        proc = procs.start("llama-server", cmd)
        base = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_healthy(base, proc, startup_timeout_s)
                run_job(f"{base}/v1", gguf.name, wl.single_stream(WARMUP_MAX_TOKENS), 1, time_limit_s,
                        "llama.cpp warm-up")
            except (RuntimeError, TimeoutError) as failure:
                raise LlamaServerFailed(str(failure)) from failure
            yield f"{base}/v1", cmd
        except LlamaServerFailed as failure:
            log = (Path(tmp) / "llama-server.log").read_text(errors="replace")[-LOG_TAIL_CHARS:]
            raise LlamaServerFailed(f"{failure}; the end of its log:\n{log}") from failure
        finally:
            procs.close()


def run_llamacpp(binary: Path, gguf: Path, jobs: list[tuple[wl.Workload, int]], time_limit_s: float,
                 threads: int = os.cpu_count() or 1, slot_context: int = 2048, startup_timeout_s: float = 300.0
                 ) -> tuple[dict | None, str | None]:
    """Run `jobs` through `llama-server` (module doc): its results, or None and why it did not run."""
    if not binary.is_file():
        return None, f"no llama-server at {binary} (`make bench` builds it)"
    slots = max(concurrency for _, concurrency in jobs)
    try:
        with llamacpp_server(binary, gguf, slots, time_limit_s, threads, slot_context, startup_timeout_s
                             ) as (base_url, cmd):
            results = [run_job(base_url, gguf.name, workload, concurrency, time_limit_s)
                       for workload, concurrency in jobs]
    except LlamaServerFailed as failure:
        return None, str(failure)
    return {"results": results, "command": cmd, "threads": threads}, None
