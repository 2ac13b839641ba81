"""What `--deterministic` costs: one worker's throughput with batch-invariant numerics against the
default, same model, same run, the two measured in turn.

    .venv/bin/python -m bench.bench_determinism [--model DIR] [--dtypes float32,bfloat16]

Workloads (`bench.bench_worker`'s, smaller): decode of one sequence, of --batch sequences, of
--batch sequences behind one shared prefix, and a prefill of --prefill-len tokens in
--prefill-prompts prompts. Each figure is the best of --repeats runs, the two settings taking
turns within each repeat (a load on the machine hits both alike). Printed: tokens/s of each, and
the deterministic one's as a fraction of the default's; the worst fraction decides whether
`--deterministic` may be the default (docs/determinism.md: at most 5% slower).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.bench_worker import DEFAULT_MODEL, DecodeBench, prefill_tokens_per_s  # noqa: E402
from worker_service.model_runner import ModelRunner, RunnerConfig  # noqa: E402

DEFAULT_COST_LIMIT = 0.05  # the slowdown at which deterministic numerics stop being the default
SETTINGS = {"default": False, "deterministic": True}


def measure(args: argparse.Namespace, dtype: str) -> dict[str, dict[str, float]]:
    """tokens/s by workload, by setting."""
    runners = {name: ModelRunner(RunnerConfig(model_dir=args.model, dtype=dtype, attention_kernel="torch",
                                              kv_cache_bytes=512 << 20, deterministic=flag))
               for name, flag in SETTINGS.items()}
    runs = args.repeats + 1
    benches = {name: {"decode x1": DecodeBench(runner, 1, args.context, args.steps, runs),
                      f"decode x{args.batch}": DecodeBench(runner, args.batch, args.context, args.steps, runs,
                                                           first_page=0)}
               for name, runner in runners.items()}
    for name, runner in runners.items():  # the shared bench after the others' pages
        end = benches[name][f"decode x{args.batch}"].end_page
        benches[name][f"decode x{args.batch} shared"] = DecodeBench(
            runner, args.batch, args.context, args.steps, runs, shared_len=args.context - 16, first_page=end)
    best: dict[str, dict[str, float]] = {name: {} for name in SETTINGS}
    for repeat in range(runs):
        for name, runner in runners.items():
            for workload, bench in benches[name].items():
                value = bench.run()
                if repeat:  # the first round warms up
                    best[name][workload] = max(best[name].get(workload, 0.0), value)
            value = prefill_tokens_per_s(runner, args.prefill_len, args.prefill_prompts)
            if repeat:
                key = f"prefill {args.prefill_len}/{args.prefill_prompts}"
                best[name][key] = max(best[name].get(key, 0.0), value)
    return best


def report_lines(dtype: str, best: dict[str, dict[str, float]]) -> list[str]:
    lines = [f"{dtype}: workload, default tok/s, deterministic tok/s, ratio"]
    ratios = []
    for workload, default in best["default"].items():
        deterministic = best["deterministic"][workload]
        ratios.append(deterministic / default)
        lines.append(f"  {workload:24} {default:9.1f} {deterministic:9.1f} {deterministic / default:6.3f}")
    worst = min(ratios)
    verdict = "within" if 1 - worst <= DEFAULT_COST_LIMIT else "over"
    lines.append(f"  worst ratio {worst:.3f}: {verdict} the {DEFAULT_COST_LIMIT:.0%} limit for a default")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256, help="tokens of each sequence before decoding")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per measurement")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prefill-prompts", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)


def defaults(model: str | Path) -> argparse.Namespace:
    """This script's settings at their defaults, for `model` (what `bench.run_all` measures)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", str(model)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_determinism", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model.name}", flush=True)
    for dtype in args.dtypes.split(","):
        print("\n".join(report_lines(dtype, measure(args, dtype))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
