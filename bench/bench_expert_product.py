"""Whether the compiled grouped-expert product pays: one MoE layer's time with it against the
same layer's per-expert PyTorch products, and that layer split into the experts' products and the
work around them (Python, op dispatch, routing, gathers and scatter-adds), against the bandwidth
floor of the experts it reads.

    PYTHONPATH=$PWD .venv/bin/python -m bench.bench_expert_product [--batch 1,8,32] [--num-threads 1] [--model DIR]

On `bench_worker --model random-moe`'s checkpoint (`bench.moe_bound`: hidden 512, 16 experts,
top-2), PyTorch backend, float32 (or `--dtype`), for each batch of random hidden rows routed by each layer's own
router, per layer (best of --repeats, each the mean of --iterations calls; on one thread the
calling thread's CPU time, which other work on a shared machine does not inflate by descheduling
the process; on more threads, wall time):
- layer:    `SparseMoE.forward` (route, sort by expert, per expert: gather its rows, gate/up
            product, SiLU-gating, down product, weight and scatter-add);
- around:   the same layer of the same checkpoint made with hidden 16 — the same routing
            structure and the same ops, products too small to cost: what a single compiled call
            for the whole grouped product could save at most;
- products: the routed experts' gate/up and down products alone, on rows gathered beforehand,
            through the same packed linear layers (what any grouped product must still compute);
- floor:    the routed experts' bytes at the read bandwidth measured in the same run (wall time);
- compiled: `SparseMoE.forward` of the same checkpoint loaded with `--attention-kernel auto`,
            which takes the compiled grouped product (`backends/grouped_experts.py`) for steps of
            up to its row limit (past it the layer is the per-expert one again; "n/a" where the
            kernel does not build), and its ratio to `layer`; `--compiled-max-rows` moves that
            limit and lifts the one on rows per expert (`CompiledExperts.takes`), to measure the
            kernel where the worker would not take it.
With `--model`, that checkpoint's MoE layers instead (any MoE family; "around" is then n/a).
The decision and its figures are in docs/models.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import bounds as machine  # noqa: E402
from bench import moe_bound  # noqa: E402
from worker_service.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from worker_service.models.moe import SparseMoE  # noqa: E402

SMALL_HIDDEN = 16


def best_mean_s(fn, repeats: int, iterations: int, clock) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        for _ in range(iterations):
            fn()
        best = min(best, (clock() - start) / iterations)
    return best


def products_only(block: SparseMoE, hidden: torch.Tensor):
    """A callable computing just the routed experts' products over pre-gathered rows, and the
    number of experts it multiplies."""
    _, expert_ids = block.route(hidden)
    inputs = []
    for expert in expert_ids.flatten().unique().tolist():
        rows = (expert_ids == expert).any(dim=-1).nonzero().flatten()
        x = hidden.index_select(0, rows)
        middle = block.backend.silu_mul(block.gate_up[expert](x))
        inputs.append((block.gate_up[expert], x, block.down[expert], middle))

    def run() -> None:
        for gate_up, x, down, middle in inputs:
            gate_up(x)
            down(middle)

    return run, len(inputs)


def moe_layers(model_dir: Path, kernel: str = "torch", dtype: str = "float32") -> list[SparseMoE]:
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, dtype=dtype, kv_cache_bytes=1 << 20,
                                      attention_kernel=kernel))
    return moe_bound.moe_blocks(runner.model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=lambda text: [int(b) for b in text.split(",")], default=[1, 8, 32])
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--compiled-max-rows", type=int, default=None,
                        help="the compiled product's row limit (default: the worker's)")
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint with MoE layers (default: random-moe)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    clock, clock_name = (time.thread_time, "thread CPU time") if args.num_threads == 1 else (time.perf_counter, "wall time")
    with tempfile.TemporaryDirectory() as scratch, torch.inference_mode():
        full = args.model or moe_bound.make_random_moe(Path(scratch) / "full")
        blocks = moe_layers(full, dtype=args.dtype)
        compiled_blocks = moe_layers(full, "auto", args.dtype)
        if any(block.experts is None for block in compiled_blocks):
            compiled_blocks = []  # the kernel does not build here (or `auto` did not take it)
        for block in compiled_blocks:
            if args.compiled_max_rows is not None:  # the kernel alone: neither of the worker's limits
                block.experts.max_rows = block.experts.max_rows_per_expert = args.compiled_max_rows
        small_blocks = ([None] * len(blocks) if args.model else
                        moe_layers(moe_bound.make_random_moe(Path(scratch) / "small", SMALL_HIDDEN), dtype=args.dtype))
        each = moe_bound.expert_bytes(blocks[0])
        first_bandwidth = machine.memory_bandwidth()
        rows = []
        for batch in args.batch:
            generator = torch.Generator().manual_seed(batch)
            dtype = blocks[0].gate_up[0].weight.dtype
            hidden = torch.randn(batch, blocks[0].gate_up[0].weight.shape[1], generator=generator).to(dtype)
            small_hidden = torch.randn(batch, SMALL_HIDDEN, generator=generator).to(dtype)
            layer_s = around_s = products_s = compiled_s = 0.0
            routed = small_routed = 0
            for index, (block, small) in enumerate(zip(blocks, small_blocks)):
                layer_s += best_mean_s(lambda: block(hidden), args.repeats, args.iterations, clock)
                if compiled_blocks:
                    compiled = compiled_blocks[index]
                    compiled_s += best_mean_s(lambda: compiled(hidden), args.repeats, args.iterations, clock)
                if small is not None:
                    around_s += best_mean_s(lambda: small(small_hidden), args.repeats, args.iterations, clock)
                    small_routed += int(small.route(small_hidden)[1].unique().numel())
                run, count = products_only(block, hidden)
                products_s += best_mean_s(run, args.repeats, args.iterations, clock)
                routed += count
            rows.append((batch, *(x / len(blocks) for x in (layer_s, around_s, products_s, routed, small_routed,
                                                             compiled_s))))
        bandwidth = max(first_bandwidth, machine.memory_bandwidth())
    print(f"{len(blocks)} MoE layers of {blocks[0].routing.num_experts} experts ({each / 2**20:.1f} MiB each), "
          f"top-{blocks[0].routing.top_k}, {args.dtype}, {args.num_threads} thread(s) ({clock_name}), read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s; per layer:")
    for batch, layer_s, around_s, products_s, routed, small_routed, compiled_s in rows:
        floor_s = routed * each / bandwidth
        compiled = (f"{compiled_s * 1e6:6.0f} us = {compiled_s / layer_s:5.2f}x the per-expert layer"
                    if compiled_blocks else "n/a")
        print(f"  batch {batch:>3}: compiled layer {compiled}")
        around = (f"{around_s * 1e6:5.0f} us = {around_s / layer_s:4.0%} of the layer ({small_routed:4.1f} experts, "
                  f"{around_s / small_routed * 1e6:3.0f} us each)" if small_routed else "n/a")
        print(f"  batch {batch:>3}: layer {layer_s * 1e6:6.0f} us ({routed:4.1f} experts); around the products "
              f"{around}; products alone {products_s * 1e6:6.0f} us; their bandwidth floor {floor_s * 1e6:6.0f} us")


if __name__ == "__main__":
    main()
