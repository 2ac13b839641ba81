"""Quantized linear products against the float32 one, per shape and row count: what chooses
`backends/linear_quant.py`'s `GEMV_MAX_ROWS` (in-register kernel vs dequantize + GEMM).

    .venv/bin/python -m bench.bench_quant_linear [--num-threads 2] [--rows 1,4,16,32,64,128]
        [--shapes qkv,o,gate_up,down,lm_head] [--baseline OTHER/quant_gemv.cpp [--rounds 3]]

For SmolLM2-135M's linear shapes it prints the milliseconds of one product by: PyTorch's float32
(`TorchLinear`, oneDNN's packed weight), the compiled kernel (`gemv`) and dequantize + float32
GEMM (`dequant+gemm`) for int8 per channel and int4 in groups of 32, and each quantized figure's
speedup over float32. Each time is the best of --repeats (the machine may be shared).

With --baseline (another checkout's `quant_gemv.cpp`) it pairs that source's `gemv` with this
one's instead, in one process: --rounds rounds, each timing both libraries on every shape, row
count and format in turn, and prints each side's median over the rounds (ms), this one's speedup
and this one's effective weight read rate (the weight's bytes over the median time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from worker_service.backends.linear_torch import TorchLinear  # noqa: E402
from worker_service.native.library import LazyLibrary  # noqa: E402
from worker_service.quant import kernels as quant_kernels  # noqa: E402
from worker_service.quant.format import quantize_int4, quantize_int8  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def best_ms(call, repeats: int, inner: int = 20) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            call()
        best = min(best, (time.perf_counter() - start) / inner)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,16,32,64,128")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head")
    parser.add_argument("--baseline", type=Path, help="another checkout's quant_gemv.cpp to pair with this one's")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    kernels = quant_kernels.load()
    if kernels is None:
        sys.exit(f"the quantized kernels do not build here: {quant_kernels.failure()}")
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    if args.baseline is not None:
        paired(kernels, args, shapes)
        return
    print(f"torch threads {torch.get_num_threads()}; ms per product (speedup over float32)")
    print(f"{'shape':>8} {'rows':>5} {'float32':>8} | {'int8 gemv':>16} {'int8 deq+gemm':>16} | "
          f"{'int4 gemv':>16} {'int4 deq+gemm':>16}")
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k) * 0.05
        plain = TorchLinear(weight)
        quantized = {"int8": quantize_int8(weight), "int4": quantize_int4(weight, 32)}
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k)
            base = best_ms(lambda: plain(x), args.repeats)
            cells = []
            for q in quantized.values():
                gemv = best_ms(lambda: kernels.gemv(x, q, None), args.repeats)
                deq = best_ms(lambda: F.linear(x, kernels.dequantize(q)), args.repeats)
                cells += [f"{gemv:7.3f} ({base / gemv:4.2f}x)", f"{deq:7.3f} ({base / deq:4.2f}x)"]
            print(f"{name:>8} {rows:>5} {base:8.3f} | {cells[0]:>16} {cells[1]:>16} | {cells[2]:>16} {cells[3]:>16}",
                  flush=True)


def paired(kernels: quant_kernels.QuantKernels, args: argparse.Namespace, shapes: dict[str, tuple[int, int]]) -> None:
    """--baseline: the other source's gemv against this one's, alternating, medians of --rounds."""
    other = LazyLibrary("radixserve-quant-baseline", [args.baseline], quant_kernels.COMPILE_FLAGS,
                        quant_kernels.REQUIRED_CPU_FLAGS, quant_kernels.QuantKernels).load()
    if other is None:
        sys.exit(f"the baseline {args.baseline} does not build")
    cases = []
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k) * 0.05
        for fmt, q in (("int8", quantize_int8(weight)), ("int4", quantize_int4(weight, 32))):
            for rows in map(int, args.rows.split(",")):
                cases.append((name, fmt, rows, q, torch.randn(rows, k)))
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for index, (_, _, _, q, x) in enumerate(cases):
            for side, lib in (("base", other), ("this", kernels)):
                times.setdefault((index, side), []).append(best_ms(lambda: lib.gemv(x, q, None), args.repeats))
    print(f"torch threads {torch.get_num_threads()}; gemv ms, median of {args.rounds} paired rounds")
    print(f"{'shape':>8} {'format':>6} {'rows':>5} {'baseline':>9} {'this':>9} {'speedup':>8} {'GB/s':>6}")
    for index, (name, fmt, rows, q, _) in enumerate(cases):
        base, this = (statistics.median(times[(index, side)]) for side in ("base", "this"))
        print(f"{name:>8} {fmt:>6} {rows:>5} {base:9.4f} {this:9.4f} {base / this:7.2f}x {q.nbytes / this / 1e6:6.1f}")


if __name__ == "__main__":
    main()
