"""Quantized linear products against the float32 one, per shape and row count: what chooses
`backends/linear_quant.py`'s `GEMV_MAX_ROWS` (in-register kernel vs dequantize + GEMM).

    .venv/bin/python -m bench.bench_quant_linear [--num-threads 2] [--rows 1,4,16,32,64,128]

For SmolLM2-135M's linear shapes it prints the milliseconds of one product by: PyTorch's float32
(`TorchLinear`, oneDNN's packed weight), the compiled kernel (`gemv`) and dequantize + float32
GEMM (`dequant+gemm`) for int8 per channel and int4 in groups of 32, and each quantized figure's
speedup over float32. Each time is the best of --repeats (the machine may be shared).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from worker_service.backends.linear_torch import TorchLinear  # noqa: E402
from worker_service.quant import kernels as quant_kernels  # noqa: E402
from worker_service.quant.format import quantize_int4, quantize_int8  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


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
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    kernels = quant_kernels.load()
    if kernels is None:
        sys.exit(f"the quantized kernels do not build here: {quant_kernels.failure()}")
    print(f"torch threads {torch.get_num_threads()}; ms per product (speedup over float32)")
    print(f"{'shape':>8} {'rows':>5} {'float32':>8} | {'int8 gemv':>16} {'int8 deq+gemm':>16} | "
          f"{'int4 gemv':>16} {'int4 deq+gemm':>16}")
    for name, (n, k) in SHAPES.items():
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


if __name__ == "__main__":
    main()
