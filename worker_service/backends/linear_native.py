"""Linear layers of decode-sized steps by the compiled small-batch kernel (`csrc/gemv.cpp`).

The weight is kept twice: in the kernel's own layout for products of up to `GEMV_MAX_ROWS` rows
(decode steps, the LM head included), and as `TorchLinear`'s for larger ones (prefill). Below
that size the kernel, which reads each weight once in passes of up to six rows, beat oneDNN, whose
kernel costs a fixed time per call beyond its bytes (figures in docs/worker-backends.md). The cost
is the second copy of every linear weight in memory.
"""

from __future__ import annotations

import torch

from worker_service.backends.base import PackedLinear
from worker_service.backends.linear_torch import TorchLinear
from worker_service.native import GemvWeight, NativeKernels

# Products of at most this many rows use the small-batch kernel (and the fused decode layers run
# for steps of at most this many tokens); larger ones go to oneDNN's kernel.
GEMV_MAX_ROWS = 128


class NativeLinear(PackedLinear):
    """The small-batch kernel's copy (`gemv`) for up to `GEMV_MAX_ROWS` rows, `larger` beyond."""

    def __init__(self, kernels: NativeKernels, gemv: GemvWeight, bias: torch.Tensor | None,
                 larger: TorchLinear) -> None:
        self.gemv = gemv
        self.bias = bias
        self.larger = larger
        self.weight = larger.weight
        self._kernels = kernels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
            return self._kernels.gemv(x, self.gemv, self.bias)
        return self.larger(x)
