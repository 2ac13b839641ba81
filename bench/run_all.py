"""`make bench`: every workload through radixserve, vLLM's CPU engine and transformers, side by side.

1. Starts the stack (`radixserve up`) and runs each workload at each concurrency through the
   public gRPC API, then the same workloads (fresh prompts, so neither run feeds the other's
   cache) through the OpenAI-compatible HTTP API; records the workers' peak memory.
2. Stops the stack and runs the same jobs through vLLM's CPU engine (offline `LLM.generate`) in
   its own virtualenv (`--vllm-python`, made by `make bench`), when that exists.
3. Runs the same jobs through transformers' `generate` in a separate process.
4. Times one prefix-cache eviction with 100k cached pages, before and after the LRU leaf queue
   (`bench.bench_eviction`; no model involved).
5. Runs speculative decoding on against off (`bench.bench_speculation`: two stacks side by side,
   the quote-and-edit workload and the workloads above, alternating).
6. Measures what `--deterministic` costs one worker (`bench.bench_determinism`: with and
   without, taking turns, in the run's dtype).
7. Writes `bench/results/latest.json`, `latest.md` and PNG plots (`bench.report`).

All engines run on the same machine in the same run, in the same dtype (`--dtype`, resolved as
the worker resolves it), one after the other, never at once.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench import bench_determinism, bench_eviction
from bench import bench_speculation
from bench import workloads as wl
from bench.loadgen import run_workload, wait_serving
from bench.http_overhead import paired
from bench.loadgen_http import run_workload_http
from bench.records import summarize
from bench.report import markdown, speculation, update_docs, write_report
from radixserve.model_source import resolve_model
from worker_service.dtypes import DTYPE_CHOICES, resolve_dtype

ROOT = Path(__file__).resolve().parent.parent
# The page whose results table `--update-docs` rewrites.
BENCHMARKS_PAGE = ROOT / "docs" / "benchmarks.md"


# Workload variants of the HTTP run start here, far from the gRPC run's.
HTTP_VARIANT_BASE = 1000


def build_jobs(args: argparse.Namespace, variant_base: int = 0) -> list[tuple[wl.Workload, int]]:
    scale = 1 if args.quick else 2
    jobs: list[tuple[wl.Workload, int]] = []
    for concurrency in args.concurrency:
        variant = variant_base + len(jobs)
        num_requests = args.num_requests or max(8, 2 * concurrency) * scale
        jobs.append((wl.shared_system_prompt(num_requests, args.max_tokens, args.system_prompt_words,
                                             variant=variant), concurrency))
        jobs.append((wl.distinct_prompts(num_requests, args.max_tokens, args.distinct_words,
                                         variant=variant), concurrency))
    jobs.append((wl.single_stream(args.single_stream_tokens, variant_base), 1))
    if not args.skip_multi_turn:
        jobs.append((wl.multi_turn(4 * scale, 4, args.max_tokens, variant_base), 4))
    return [(replace(w, temperature=args.temperature, top_p=args.top_p), c) for w, c in jobs]


def worker_pids(launcher_pid: int) -> list[int]:
    """Pids of the launcher's descendants that run `worker_service`."""
    parents: dict[int, int] = {}
    cmdlines: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue

    def descends(pid: int) -> bool:
        seen = 0
        while pid in parents and seen < 64:
            if parents[pid] == launcher_pid:
                return True
            pid, seen = parents[pid], seen + 1
        return False

    return [pid for pid, cmd in cmdlines.items() if "worker_service" in cmd and descends(pid)]


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _run_job(run, workload: wl.Workload, concurrency: int, label: str) -> dict:
    """`run(workload, concurrency)` -> (records, wall_s); the job's summary."""
    records, wall_s = asyncio.run(run(workload, concurrency))
    summary = summarize(records, wall_s)
    print(f"[{label}] {workload.name} c={concurrency}: {summary['output_tokens_per_s']} out tok/s, "
          f"ttft p50 {summary['ttft_p50_ms']} ms, itl p50 {summary['itl_p50_ms']} ms, "
          f"hit rate {summary['cache_hit_rate']}", flush=True)
    return {"workload": workload.name, "concurrency": concurrency, **summary}


@dataclass
class Stack:
    """A running `radixserve up` (`radixserve_up`): where its APIs answer, the name it serves the
    model under, and the launcher's process."""
    address: str
    base_url: str
    model: str
    proc: subprocess.Popen
    time_limit_s: float

    def grpc(self, workload: wl.Workload, concurrency: int, label: str = "radixserve") -> dict:
        return _run_job(lambda w, c: run_workload(self.address, w, c, self.time_limit_s), workload, concurrency,
                        label)

    def http(self, workload: wl.Workload, concurrency: int, label: str = "radixserve http") -> dict:
        return _run_job(lambda w, c: run_workload_http(self.base_url, self.model, w, c, self.time_limit_s),
                        workload, concurrency, label)

    def worker_peak_rss_mb(self) -> list[float]:
        return [round(peak_rss_mb(pid), 1) for pid in worker_pids(self.proc.pid)]


@contextmanager
def radixserve_up(args: argparse.Namespace) -> Iterator[Stack]:
    """`radixserve up` with `args`' model, TP, ports and dtype, serving and warmed by one short
    request (as every peer gets one); stopped, its whole process group, on leaving."""
    cmd = [str(ROOT / ".venv" / "bin" / "radixserve"), "up", "--model", args.model,
           "--tp", str(args.tp), "--port", str(args.port), "--http-port", str(args.http_port),
           "--metrics-port", "0", "--dtype", args.dtype]
    print(f"[bench] starting: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL if not args.verbose else None)
    address = f"127.0.0.1:{args.port}"
    try:
        asyncio.run(wait_serving(address, proc, args.startup_timeout_s))
        asyncio.run(run_workload(address, wl.single_stream(4), 1, args.time_limit_s))
        # The name the workers serve the model under (a GGUF file's stem).
        yield Stack(address, f"http://127.0.0.1:{args.http_port}/v1", resolve_model(args.model).name, proc,
                    args.time_limit_s)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)


def run_server_side(args: argparse.Namespace, jobs: list[tuple[wl.Workload, int]],
                    http_jobs: list[tuple[wl.Workload, int]]) -> dict:
    with radixserve_up(args) as stack:
        results, http_results, http_paired = [], [], None
        # Each job through gRPC and then at once through HTTP, so that both see the same
        # machine load (the comparison is between neighbours, not between halves of the run).
        for index, (workload, concurrency) in enumerate(jobs):
            results.append(stack.grpc(workload, concurrency))
            if http_jobs:
                http_results.append(stack.http(*http_jobs[index]))
        if http_jobs and args.paired_requests:
            http_paired = asyncio.run(paired(stack.address, stack.base_url, stack.model, args.paired_requests,
                                             args.max_tokens))
            print(f"[radixserve http] paired: {http_paired}", flush=True)
        peaks = stack.worker_peak_rss_mb()
    return {"results": results, "http_results": http_results, "http_paired": http_paired,
            "worker_peak_rss_mb": peaks}


def write_jobs(args: argparse.Namespace, jobs: list[tuple[wl.Workload, int]], path: Path) -> None:
    path.write_text(json.dumps([
        {"workload": asdict(w), "concurrency": c, "model_dir": args.model, "time_limit_s": args.time_limit_s}
        for w, c in jobs
    ]))


def run_peer_side(args: argparse.Namespace, jobs: list[tuple[wl.Workload, int]], dtype: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "jobs.json", Path(tmp) / "out.json"
        write_jobs(args, jobs, job_file)
        subprocess.run([sys.executable, "-m", "bench.peer_transformers", "--job", str(job_file),
                        "--out", str(out_file), "--dtype", dtype], cwd=ROOT, check=True)
        return json.loads(out_file.read_text())


def run_vllm_side(args: argparse.Namespace, jobs: list[tuple[wl.Workload, int]], dtype: str
                  ) -> tuple[dict | None, str | None]:
    """vLLM's results, or None and why it did not run (the rest of the bench goes on without it)."""
    if not args.vllm_python.is_file():
        return None, f"no vLLM virtualenv at {args.vllm_python} (`make bench` makes one)"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kvcache_gib),
           "VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind or f"0-{os.cpu_count() - 1}"}
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "jobs.json", Path(tmp) / "out.json"
        write_jobs(args, jobs, job_file)
        cmd = [str(args.vllm_python), "-m", "bench.peer_vllm", "--job", str(job_file), "--out", str(out_file),
               "--dtype", dtype]
        print(f"[bench] starting: {' '.join(cmd)}", flush=True)
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, timeout=args.vllm_timeout_s)
        except subprocess.TimeoutExpired:
            return None, f"vLLM did not finish within {args.vllm_timeout_s:.0f} s"
        if done.returncode != 0 or not out_file.is_file():
            return None, f"vLLM exited with {done.returncode} (its log is above)"
        return json.loads(out_file.read_text()), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct", help="model folder")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the stack")
    parser.add_argument("--port", type=int, default=50151, help="gateway port of the benchmarked stack")
    parser.add_argument("--http-port", type=int, default=50250, help="HTTP API port of the benchmarked stack")
    parser.add_argument("--skip-http", action="store_true", help="do not run the workloads through HTTP")
    parser.add_argument("--paired-requests", type=int, default=20,
                        help="pairs of one-at-a-time requests alternating gRPC and HTTP (bench.http_overhead)")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16],
                        help="comma-separated concurrency levels for the shared-prefix and distinct workloads")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every engine samples at this temperature (0: greedy, the issue's workloads)")
    parser.add_argument("--top-p", type=float, default=1.0, help="top_p of the sampled replies (with --temperature)")
    parser.add_argument("--single-stream-tokens", type=int, default=256, help="output tokens of the single stream")
    parser.add_argument("--time-limit-s", type=float, default=180.0, help="per run: no new conversations after this")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0, help="wait this long for the stack")
    parser.add_argument("--quick", action="store_true", help="half the requests per run")
    parser.add_argument("--num-requests", type=int, default=0,
                        help="requests per shared/distinct run (0: twice the concurrency, at least 8, x2 unless --quick)")
    parser.add_argument("--system-prompt-words", type=int, default=450,
                        help="words of the shared system prompt (about 1.1 tokens each)")
    parser.add_argument("--distinct-words", type=int, default=150, help="words of each distinct prompt")
    parser.add_argument("--skip-multi-turn", action="store_true", help="leave the multi-turn workload out")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="every engine's dtype; auto resolves as the worker does")
    parser.add_argument("--skip-peer", action="store_true", help="do not run transformers")
    parser.add_argument("--skip-vllm", action="store_true", help="do not run vLLM")
    parser.add_argument("--vllm-python", type=Path, default=ROOT / ".peers" / "vllm" / "bin" / "python",
                        help="python of vLLM's own virtualenv")
    parser.add_argument("--vllm-kvcache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE for vLLM")
    parser.add_argument("--vllm-threads-bind", default="",
                        help="VLLM_CPU_OMP_THREADS_BIND for vLLM (default: every core, 0-N)")
    parser.add_argument("--vllm-timeout-s", type=float, default=3600.0,
                        help="give up on vLLM after this long (its first start compiles)")
    parser.add_argument("--skip-speculation", action="store_true",
                        help="do not compare speculative decoding on and off")
    parser.add_argument("--only-speculation", action="store_true",
                        help="run only the speculation comparison (with --workloads to pick some)")
    bench_speculation.add_arguments(parser)
    parser.add_argument("--skip-determinism", action="store_true",
                        help="do not measure what --deterministic costs")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results", help="where results go")
    parser.add_argument("--verbose", action="store_true", help="show the stack's logs")
    parser.add_argument("--update-docs", action="store_true",
                        help="also put the table into docs/benchmarks.md between its benchmark markers")
    args = parser.parse_args()

    dtype = resolve_dtype(args.dtype, "cpu")
    if args.only_speculation:
        print_speculation(bench_speculation.run(argparse.Namespace(**{**vars(args), "dtype": dtype})))
        return
    jobs = build_jobs(args)
    http_jobs = [] if args.skip_http else build_jobs(args, HTTP_VARIANT_BASE)
    server = run_server_side(args, jobs, http_jobs)
    vllm, vllm_skipped = (None, "--skip-vllm") if args.skip_vllm else run_vllm_side(args, jobs, dtype)
    if vllm_skipped:
        print(f"[bench] vLLM skipped: {vllm_skipped}", flush=True)
    peer = {"results": [], "peak_rss_mb": None} if args.skip_peer else run_peer_side(args, jobs, dtype)
    eviction = bench_eviction.measure()
    print("\n".join(f"[bench] {line}" for line in bench_eviction.report_lines(eviction)))
    spec = None
    if not args.skip_speculation:
        spec = bench_speculation.run(argparse.Namespace(**{**vars(args), "dtype": dtype}))
    determinism = None
    if not args.skip_determinism:
        determinism = bench_determinism.measure(bench_determinism.defaults(args.model), dtype)
        print("\n".join(f"[bench] {line}" for line in bench_determinism.report_lines(dtype, determinism)), flush=True)
    report = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_implementation()} "
                   f"{platform.python_version()}",
        "model": args.model, "tp": args.tp, "dtype": dtype,
        "sampling": {"temperature": args.temperature, "top_p": args.top_p},
        "radixserve": server, "vllm": vllm, "vllm_skipped": vllm_skipped, "transformers": peer,
        "eviction_seconds_per_call": eviction,
        "speculation": spec,
        "determinism_tokens_per_s": determinism,
    }
    write_report(report, args.out_dir)
    if args.update_docs and not update_docs(BENCHMARKS_PAGE, markdown(report)):
        print(f"[bench] {BENCHMARKS_PAGE} has no benchmark markers; left it alone", flush=True)
    print(f"[bench] wrote {args.out_dir}/latest.json, latest.md and plots", flush=True)


def print_speculation(spec: dict) -> None:
    print("\n".join(speculation({"speculation": spec})), flush=True)


if __name__ == "__main__":
    main()
