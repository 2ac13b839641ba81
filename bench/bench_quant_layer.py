"""Single-stream decode with quantized weights on a CPU without the main compiled library: the
compiled quantized decoder layer (`backends/fused_quant_llama.py`) paired with the PyTorch module
path it replaces, in one run.

    .venv/bin/python -m bench.bench_quant_layer [--configs none:bfloat16,int4:float32,...] [--rounds 3]

Every runner is built first; then each round times --steps decode steps of one sequence (a prompt
of --context tokens) for every config, first on the module path and then on the compiled layer
(the same runner, the same sequence continued), so a slow moment of the shared machine falls on
both. Each figure is printed as the median and the best of its rounds, with the best's fraction
of the bandwidth bound for the run's own bytes (weights as stored, K/V at --context; the read
bandwidth of `bench.bounds`, measured at the start and the end, the larger counting), and the
quantized figures over `none:bfloat16`'s (the issue's goals: int8 1.7x, int4 2.5x). `gguf` runs
the GGUF file --gguf as it is; `+head8` after one gives the LM head an int8 copy too
(`--lm-head-quantization int8`). The layer runs only where the selection takes it (a CPU without
AVX-512); elsewhere a config has only its module-path figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import bounds as machine  # noqa: E402
from bench.bench_worker import DEFAULT_GGUF, DEFAULT_MODEL, GGUF, PAGE_SIZE, DecodeBench, runner_shape, \
    tokens_each  # noqa: E402
from bench.bench_worker import QUANTIZED_SINGLE_GOALS  # noqa: E402
from bench.quant_configs import split_config  # noqa: E402
from worker_service.kv_pool import KVPool  # noqa: E402
from worker_service.model_runner import ModelRunner, RunnerConfig  # noqa: E402

PATHS = ("module", "layer")  # the PyTorch module path, the compiled quantized layer


def build(quantization: str, dtype: str, args: argparse.Namespace) -> tuple[ModelRunner, DecodeBench]:
    weights, head, activations = split_config(quantization)
    model = args.gguf if weights == GGUF else args.model
    num_layers, num_kv_heads, head_dim = runner_shape(model)
    pages = -(-tokens_each(args.context, args.steps, 2 * args.rounds + 1) // PAGE_SIZE) + 1
    budget = pages * KVPool.bytes_per_page(num_layers, PAGE_SIZE, num_kv_heads, head_dim, getattr(torch, dtype))
    runner = ModelRunner(RunnerConfig(model_dir=model, dtype=dtype, page_size=PAGE_SIZE, kv_cache_bytes=budget,
                                      quantization="none" if weights == GGUF else weights,
                                      lm_head_quantization=head, activation_quantization=activations))
    bench = DecodeBench(runner, 1, args.context, args.steps, 2 * args.rounds + 1)
    bench.run()  # warm-up
    return runner, bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--configs", default="none:bfloat16,none:float32,int8:bfloat16,int8:float32,"
                                             "int4:bfloat16,int4:float32,gguf:bfloat16,gguf:float32",
                        help="comma-separated quantization:dtype pairs (quantization: none, int8, int4, gguf; "
                             "+head8 after one: the LM head in int8 too)")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    configs = [tuple(config.split(":")) for config in args.configs.split(",")]
    dtypes = sorted({dtype for _, dtype in configs})
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f} at start", flush=True)
    first_bounds = machine.measure(dtypes)
    built = {config: build(*config, args) for config in configs}
    for (quantization, dtype), (runner, _) in built.items():
        print(f"{quantization} {dtype} [{runner.info.quantization}]: {runner.backend_reason}", flush=True)
    times: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(args.rounds):
        for config, (runner, bench) in built.items():
            fused = runner.fused
            for path in PATHS if fused is not None else PATHS[:1]:
                runner.fused = fused if path == "layer" else None
                times.setdefault((*config, path), []).append(bench.run())
            runner.fused = fused
    bounds = machine.best_of(first_bounds, machine.measure(dtypes))
    print(f"read bandwidth {bounds.bandwidth_bytes_per_s / 1e9:.1f} GB/s; decode x1 at {args.context} positions, "
          f"{args.steps} steps, {args.rounds} rounds: tokens/s median / best (best's fraction of the bandwidth "
          "bound, of tokens/s)")
    best: dict[tuple[str, str, str], float] = {}
    for (quantization, dtype, path), values in times.items():
        runner = built[(quantization, dtype)][0]
        shape = machine.step_shape(runner)
        # Bytes only: `decode_bound_tokens_per_s` would also bound by the dtype's GEMM throughput,
        # which a quantized product (float32 arithmetic) does not run at.
        bound = bounds.bandwidth_bytes_per_s / (shape.weight_bytes + args.context * shape.kv_bytes_per_position)
        best[(quantization, dtype, path)] = max(values)
        print(f"{quantization:>5} {dtype:>8} {path:>6}: {statistics.median(values):6.1f} / {max(values):6.1f} "
              f"({max(values) / bound:4.0%} of {bound:.0f})  runs " + " ".join(f"{v:.1f}" for v in values), flush=True)
    for (quantization, dtype, path), value in best.items():
        if path == "layer":
            module = best[(quantization, dtype, "module")]
            print(f"{quantization} {dtype}: compiled layer {value / module:.2f}x the module path (best of each)")
    base = best.get(("none", "bfloat16", "module"))
    for (quantization, dtype, path), value in best.items():
        goal = QUANTIZED_SINGLE_GOALS.get(split_config(quantization)[0])
        only_module = (quantization, dtype, "layer") not in best
        if base is not None and quantization != "none" and (path == "layer" or only_module):
            print(f"{quantization} {dtype} ({path}): {value / base:.2f}x bfloat16's single stream"
                  + ("" if goal is None else f" (goal {goal}x)"))
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
