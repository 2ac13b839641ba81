"""Quantized products over activations quantized to 8 bits (`--activation-quantization int8`,
`csrc/quant_gemv_int8.cpp`): against PyTorch's float32 product over the dequantized weight of
the activations quantized per block of 32 columns as the kernel does (`quantize_blocks` below,
the reference), within float32 tolerance, for 1-8 rows and odd numbers of groups; against the
exact float32 product within the rounding that quantization costs; products it does not take
(more rows, other layouts) unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_service.backends.linear_quant import GEMV_MAX_ROWS, CompiledQuantLinear
from worker_service.quant import kernels as quant_kernels
from worker_service.quant.format import QuantizedWeight, quantize_int4, quantize_int8

BLOCK = 32
# Each product sums K <= 600 terms in float32 in another order than the float64 reference.
RTOL, ATOL = 1e-5, 1e-4
# Against the exact product: each activation moves by at most half a step (max|x| / 254 in its
# block), so for Gaussian x and weights an output moves by about sqrt(K) * 0.3 * |w| * max|x|
# / 254 / sqrt(3); measured over these shapes the relative error (the norm of the difference
# over the norm of the exact output) stays under 1.5%; 3% bounds it.
EXACT_RTOL = 0.03

FORMATS = {
    "int8-channel": lambda w: quantize_int8(w),  # one group a row (K a multiple of 32 below)
    "int8-g16": lambda w: quantize_int8(w, 16),  # GGUF's Q6_K
    "int8-g32": lambda w: quantize_int8(w, 32),  # GGUF's Q8_0
    "int4-g32": lambda w: quantize_int4(w, 32),  # GGUF's Q4_0, Q4_1, Q4_K
    "int4-g64": lambda w: quantize_int4(w, 64),
    "int4-g96": lambda w: quantize_int4(w, 96),  # groups that cut the kernel's 64-column spans
}
# (N, K): an odd number of blocks of 32 (7, 15, 9), and for int4 K off the blocks (257, 40).
SHAPES = {"int8": [(37, 224), (130, 480), (5, 96)], "int4": [(37, 224), (130, 576), (77, 257), (3, 40)]}


def quantize_blocks(x: torch.Tensor) -> torch.Tensor:
    """`x` `[rows, K]` float32 as the kernel rounds it: per block of 32 columns (the last one
    padded with zeros), d = max|x| / 127, q = round-half-even(x * (1 / d)) (0 where d is 0),
    clamped to -127..127; returns q * d."""
    rows, k = x.shape
    padded = F.pad(x.float(), (0, -k % BLOCK)).view(rows, -1, BLOCK)
    d = padded.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(padded * inverse).clamp(-127, 127)
    return (q * d).view(rows, -1)[:, :k]


def reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(quantize_blocks(x).double(), weight.dequantize(torch.float64),
                    None if bias is None else bias.double()).float()


def compiled_kernels() -> quant_kernels.QuantKernels:
    kernels = quant_kernels.load()
    if kernels is None:
        pytest.skip(f"the quantized kernels do not build here: {quant_kernels.failure()}")
    return kernels


def cases():
    for name in FORMATS:
        for shape in SHAPES[name[:4]]:
            yield name, shape


@pytest.mark.parametrize(("name", "shape"), list(cases()), ids=str)
def test_products_equal_the_product_over_activations_quantized_per_block(name, shape) -> None:
    n, k = shape
    generator = torch.Generator().manual_seed(n * k)
    weight = FORMATS[name](torch.randn(n, k, generator=generator) * 0.1)
    bias = torch.randn(n, generator=generator)
    kernels = compiled_kernels()
    linear = CompiledQuantLinear(kernels, weight, bias, False, int8_activations=True)
    for rows in range(1, GEMV_MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=generator)
        x[0, : min(k, BLOCK)] = 0.0  # a block of zeros: d = 0
        got = linear(x)
        torch.testing.assert_close(got, reference(x, weight, bias), rtol=RTOL, atol=ATOL, msg=f"{rows} rows")
        exact = F.linear(x.double(), weight.dequantize(torch.float64), bias.double()).float()
        error = (got - exact).norm() / exact.norm()
        assert error < EXACT_RTOL, f"{rows} rows: relative error {error:.4f} against the float32 product"


def test_more_rows_and_layouts_it_does_not_take_are_the_float32_products() -> None:
    """Past `GEMV_MAX_ROWS` rows (prefill) the product is the float32 one over the dequantized
    weight; so is an int8 weight whose K is not a multiple of 32 (the kernel leaves it)."""
    kernels = compiled_kernels()
    generator = torch.Generator().manual_seed(7)
    for weight, rows in ((quantize_int4(torch.randn(40, 100, generator=generator)), GEMV_MAX_ROWS + 1),
                         (quantize_int8(torch.randn(40, 100, generator=generator), 16), 3)):
        x = torch.randn(rows, weight.in_features, generator=generator)
        got = CompiledQuantLinear(kernels, weight, None, True, int8_activations=True)(x)
        exact = F.linear(x.double(), weight.dequantize(torch.float64)).float()
        torch.testing.assert_close(got, exact, rtol=RTOL, atol=ATOL)
        assert not torch.allclose(got, reference(x, weight, None), rtol=RTOL, atol=ATOL)
