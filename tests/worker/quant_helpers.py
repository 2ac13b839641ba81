"""What the quantized-product tests share: the formats they quantize a weight into, the compiled
kernels (or a skip naming why they do not build), and the exact product they are held to."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_service.quant import kernels as quant_kernels
from worker_service.quant.format import QuantizedWeight, quantize_int4, quantize_int8

FORMATS = {
    "int8-channel": lambda w: quantize_int8(w),  # one group a row
    "int8-g16": lambda w: quantize_int8(w, 16),  # GGUF's Q6_K
    "int8-g32": lambda w: quantize_int8(w, 32),  # GGUF's Q8_0
    "int4-g32": lambda w: quantize_int4(w, 32),  # GGUF's Q4_0, Q4_1, Q4_K
    "int4-g64": lambda w: quantize_int4(w, 64),
    "int4-g96": lambda w: quantize_int4(w, 96),  # groups that cut the kernel's 64-column spans
    "int4-g128": lambda w: quantize_int4(w, 128),  # groups of two spans
}


def compiled_kernels() -> quant_kernels.QuantKernels:
    kernels = quant_kernels.load()
    if kernels is None:
        pytest.skip(f"the quantized kernels do not build here: {quant_kernels.failure()}")
    return kernels


def exact_product(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """PyTorch's product of `x` and the dequantized weight, in float64, returned in float32."""
    return F.linear(x.double(), weight.dequantize(torch.float64), None if bias is None else bias.double()).float()


def random_case(name: str, n: int, k: int) -> tuple[QuantizedWeight, torch.Tensor, torch.Generator]:
    """A random `[n, k]` weight in format `name`, a bias, and the generator to draw activations
    from, all seeded by the shape."""
    generator = torch.Generator().manual_seed(n * k)
    weight = FORMATS[name](torch.randn(n, k, generator=generator) * 0.1)
    return weight, torch.randn(n, generator=generator), generator
