"""Linear layers over quantized weights (`format.QuantizedWeight`): what a backend's `pack`
returns for one, in one of two ways chosen once per worker (`QuantizedLinears`):

- `DequantizingLinear`, the reference and what runs wherever the compiled kernels do not (CUDA,
  `--attention-kernel torch`, a CPU without AVX2/FMA): each product dequantizes the weight to
  float32 and multiplies in float32 with PyTorch's `F.linear`.
- `CompiledQuantLinear` on CPU where `quant/kernels.py` builds: up to `GEMV_MAX_ROWS` rows by
  the kernel that dequantizes in registers (a decode step reads each weight byte once per four
  rows); larger products (prefill) dequantize the weight with the compiled kernel and run one
  float32 GEMM, which beats re-reading the weight once per four rows past that size. With
  `int8_activations` (`--activation-quantization int8`) the kernel first rounds the activations
  to 8 bits per block of 32 columns and multiplies in integers (`quant/kernels.py`).

Either way the weight stays quantized in memory, the product is float32's over the dequantized
weight (summed in a different order; of the activations as rounded to 8 bits where
`int8_activations`), and the result comes back in the activations' dtype (float32 where
`float32_out`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_service.backends.base import PackedLinear
from worker_service.quant.format import QuantizedWeight
from worker_service.quant.kernels import QuantKernels

# Products of at most this many rows use the in-register kernel; larger ones dequantize + GEMM
# (docs/quantization.md has the measurement behind it: over a model's weights, which do not stay
# in the caches, dequantizing costs more than the kernel's passes up to about 64 rows for float32
# activations and 96 for int8 ones; a verify step of speculative decoding, 1 + 8 rows, and decode
# steps of a few dozen requests stay on the kernel).
GEMV_MAX_ROWS = 32


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
                 float32_out: bool, int8_activations: bool = False) -> None:
        super().__init__(weight, bias, float32_out)
        self._kernels = kernels
        self.int8_activations = int8_activations

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
            out = self._kernels.gemv(x, self.quantized, self.bias, self.int8_activations)
            return out if self.float32_out else out.to(x.dtype)
        return super().__call__(x)

    def _plain(self) -> torch.Tensor:
        return self._kernels.dequantize(self.quantized)


class StackedLinear(PackedLinear):
    """Row blocks of one weight packed separately (their layouts differ: a GGUF file's q and k in
    Q4_K beside v in Q6_K), their outputs side by side as one product's."""

    def __init__(self, parts: list[PackedLinear]) -> None:
        self.parts = parts
        self.weight = parts[0].weight
        self.extra_bytes = sum(p.extra_bytes for p in parts) + sum(p.weight.nbytes for p in parts[1:])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def pack_row_blocks(pack: Callable[..., PackedLinear], blocks: list[QuantizedWeight],
                    bias: torch.Tensor | None) -> PackedLinear:
    """`blocks` (consecutive rows of one weight) packed by `pack` (a backend's), with their
    slices of `bias`: one packed weight, or a `StackedLinear` of several."""
    if len(blocks) == 1:
        return pack(blocks[0], bias)
    parts, start = [], 0
    for block in blocks:
        stop = start + block.out_features
        parts.append(pack(block, None if bias is None else bias[start:stop]))
        start = stop
    return StackedLinear(parts)


@dataclass(frozen=True, slots=True)
class QuantizedLinears:
    """How this worker multiplies quantized weights: by `kernels` where given (over activations
    rounded to 8 bits where `int8_activations`), else dequantizing."""

    kernels: QuantKernels | None = None
    int8_activations: bool = False

    def __post_init__(self) -> None:
        if self.int8_activations and self.kernels is None:
            raise ValueError("int8 activations need the compiled quantized kernels")

    def pack(self, weight: QuantizedWeight, bias: torch.Tensor | None, float32_out: bool) -> PackedLinear:
        if self.kernels is not None and weight.values.device.type == "cpu":
            return CompiledQuantLinear(self.kernels, weight, bias, float32_out, self.int8_activations)
        return DequantizingLinear(weight, bias, float32_out)

    @property
    def description(self) -> str:
        if self.kernels is None:
            return "quantized weights dequantized for each product (PyTorch)"
        activations = ", activations rounded to int8 per block of 32" if self.int8_activations else ""
        return (f"quantized weights by the compiled AVX2 kernels (up to {GEMV_MAX_ROWS} rows{activations}; "
                "dequantize + GEMM beyond)")
