"""Linear layers over quantized weights (`format.QuantizedWeight`): what a backend's `pack`
returns for one, in one of two ways chosen once per worker (`QuantizedLinears`):

- `DequantizingLinear`, the reference and what runs wherever the compiled kernels do not (CUDA,
  `--attention-kernel torch`, a CPU without AVX2/FMA): each product dequantizes the weight to
  float32 and multiplies in float32 with PyTorch's `F.linear`.
- `CompiledQuantLinear` on CPU where `quant/kernels.py` builds: up to `GEMV_MAX_ROWS` rows by
  the kernel that dequantizes in registers (a decode step reads each weight byte once per four
  rows); larger products (prefill) dequantize the weight with the compiled kernel and run one
  float32 GEMM, which beats re-reading the weight once per four rows past that size.

Either way the weight stays quantized in memory, the product is float32's over the dequantized
weight (summed in a different order), and the result comes back in the activations' dtype
(float32 where `float32_out`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_service.backends.base import PackedLinear
from worker_service.quant.format import QuantizedWeight
from worker_service.quant.kernels import QuantKernels

# Products of at most this many rows use the in-register kernel; larger ones dequantize + GEMM
# (docs/quantization.md has the measurement behind it).
GEMV_MAX_ROWS = 8


class DequantizingLinear(PackedLinear):
    """x @ dequantized(weight).T (+ bias) in float32, the weight dequantized for every product."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, float32_out: bool) -> None:
        self.quantized = weight
        self.weight = weight.values
        self.extra_bytes = weight.nbytes - weight.values.nbytes
        self.bias = None if bias is None else bias.float()
        self.float32_out = float32_out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.float(), self._plain(), self.bias)
        return out if self.float32_out else out.to(x.dtype)

    def _plain(self) -> torch.Tensor:
        return self.quantized.dequantize(torch.float32)


class CompiledQuantLinear(DequantizingLinear):
    """The compiled kernel for up to `GEMV_MAX_ROWS` rows, dequantize + GEMM beyond (module doc)."""

    def __init__(self, kernels: QuantKernels, weight: QuantizedWeight, bias: torch.Tensor | None,
                 float32_out: bool) -> None:
        super().__init__(weight, bias, float32_out)
        self._kernels = kernels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
            out = self._kernels.gemv(x, self.quantized, self.bias)
            return out if self.float32_out else out.to(x.dtype)
        return super().__call__(x)

    def _plain(self) -> torch.Tensor:
        return self._kernels.dequantize(self.quantized)


@dataclass(frozen=True, slots=True)
class QuantizedLinears:
    """How this worker multiplies quantized weights: by `kernels` where given, else dequantizing."""

    kernels: QuantKernels | None = None

    def pack(self, weight: QuantizedWeight, bias: torch.Tensor | None, float32_out: bool) -> PackedLinear:
        if self.kernels is not None and weight.values.device.type == "cpu":
            return CompiledQuantLinear(self.kernels, weight, bias, float32_out)
        return DequantizingLinear(weight, bias, float32_out)

    @property
    def description(self) -> str:
        if self.kernels is None:
            return "quantized weights dequantized for each product (PyTorch)"
        return f"quantized weights by the compiled AVX2 kernels (up to {GEMV_MAX_ROWS} rows; dequantize + GEMM beyond)"
