"""Quantized linear products: each format's product against PyTorch's float32 product over the
dequantized weight (odd shapes, 1-300 rows), by the dequantizing reference and by the compiled
AVX2 kernels; tensor-parallel shards of a quantized weight (whole rows, columns on group
boundaries) against the whole product; products that read nothing past their operands."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from worker.quant_helpers import FORMATS, compiled_kernels, exact_product, random_case
from worker_service.backends import select_backend
from worker_service.backends.linear_quant import GEMV_MAX_ROWS, CompiledQuantLinear, DequantizingLinear
from worker_service.quant import kernels as quant_kernels
from worker_service.quant.format import quantize_int4, quantize_int8, unpack_int4
from worker_service.quant.scheme import quantizer

# Products in float32 summed in another order over K <= 600: a few ulps of the result's scale.
RTOL, ATOL = 1e-5, 1e-4

SHAPES = [(1, 40), (37, 100), (130, 576), (77, 257)]  # (N, K): K not a multiple of 8 / 32 / 64 too
ROWS = [1, 3, 5, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 300]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", FORMATS)
def test_quantized_products_match_the_dequantized_weights(name, shape) -> None:
    n, k = shape
    weight, bias, generator = random_case(name, n, k)
    kernels = compiled_kernels()
    for rows in ROWS:
        x = torch.randn(rows, k, generator=generator)
        expected = exact_product(x, weight, bias)
        for linear in (DequantizingLinear(weight, bias, False), CompiledQuantLinear(kernels, weight, bias, False)):
            torch.testing.assert_close(linear(x), expected, rtol=RTOL, atol=ATOL, msg=f"{type(linear).__name__}")


def _followed_by(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in a buffer whose next 64 bytes are NaN (floats) or have every bit set
    (bytes): a kernel that reads past the tensor gets those instead of whatever memory follows."""
    fill = float("nan") if tensor.is_floating_point() else (255 if tensor.dtype == torch.uint8 else -1)
    buffer = torch.full((tensor.numel() + 64 // tensor.element_size(),), fill, dtype=tensor.dtype)
    buffer[:tensor.numel()] = tensor.flatten()
    return buffer[:tensor.numel()].view(tensor.shape)


def _past_operands_cases():
    # int4 in groups of 32 over an odd number of 32-column blocks: the last span holds one block,
    # and a kernel loading a pair of scales for it reads the float past the last row's scales.
    for name in FORMATS:
        for int8_activations in (False, True):
            yield pytest.param(name, int8_activations,
                               id=f"{name}-{'int8-activations' if int8_activations else 'float32'}")


@pytest.mark.parametrize(("name", "int8_activations"), list(_past_operands_cases()))
def test_a_product_reads_nothing_past_its_operands(name, int8_activations) -> None:
    """Every operand followed by NaN (bytes by 0xFF): the product is the one over the operands
    alone, finite and bit for bit the same. K = 96 and 257 leave the last int4 span one block (an
    odd number of 32-column blocks) and cut the last int8 group."""
    kernels = compiled_kernels()
    for n, k in [(37, 96), (77, 257)]:
        weight, bias, generator = random_case(name, n, k)
        guarded = dataclasses.replace(weight, values=_followed_by(weight.values), scales=_followed_by(weight.scales),
                                      offsets=None if weight.offsets is None else _followed_by(weight.offsets))
        for rows in (1, 5):
            x = torch.randn(rows, k, generator=generator)
            out = kernels.gemv(_followed_by(x), guarded, _followed_by(bias), int8_activations)
            assert out.isfinite().all(), f"non-finite features {(~out.isfinite()).nonzero()[:, 1].unique().tolist()}"
            torch.testing.assert_close(out, kernels.gemv(x, weight, bias, int8_activations), rtol=0, atol=0)


def test_bfloat16_activations_come_back_in_bfloat16_and_float32_out_in_float32() -> None:
    weight = quantize_int4(torch.randn(64, 96) * 0.1)
    x = torch.randn(2, 96).to(torch.bfloat16)
    linear = CompiledQuantLinear(compiled_kernels(), weight, None, False)
    assert linear(x).dtype == torch.bfloat16
    logits = CompiledQuantLinear(compiled_kernels(), weight, None, True)(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, exact_product(x.float(), weight, None), rtol=RTOL, atol=ATOL)


def test_compiled_dequantize_is_the_reference_dequantize() -> None:
    kernels = compiled_kernels()
    for make in FORMATS.values():
        weight = make(torch.randn(33, 200))
        torch.testing.assert_close(kernels.dequantize(weight), weight.dequantize(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["int8-g32", "int4-g32", "int4-g64"])
def test_tensor_parallel_shards_keep_whole_groups(name) -> None:
    """TP=2: column-parallel shards (rows) concatenate, row-parallel shards (columns on group
    boundaries) sum, to the whole weight's product."""
    weight = FORMATS[name](torch.randn(90, 384) * 0.1)
    x = torch.randn(7, 384)
    kernels = compiled_kernels()
    whole = exact_product(x, weight, None)
    by_rows = [kernels.gemv(x, weight.rows(part), None) for part in (range(0, 60), range(60, 90))]
    torch.testing.assert_close(torch.cat(by_rows, dim=1), whole, rtol=RTOL, atol=ATOL)
    by_cols = [kernels.gemv(x[:, part.start:part.stop], weight.cols(part), None)
               for part in (range(0, 192), range(192, 384))]
    torch.testing.assert_close(by_cols[0] + by_cols[1], whole, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="cut groups"):
        weight.cols(range(0, 100))


def test_quantizers_round_to_the_nearest_level() -> None:
    weight = torch.randn(16, 256)
    int8 = quantize_int8(weight)
    assert int8.values.dtype == torch.int8 and int8.scales.shape == (16, 1)
    assert (int8.dequantize() - weight).abs().le(int8.scales / 2 + 1e-6).all()
    int4 = quantize_int4(weight, 64)
    assert int4.values.shape == (16, 128) and int4.scales.shape == int4.offsets.shape == (16, 4)
    step = int4.scales.repeat_interleave(64, dim=1)
    assert (int4.dequantize() - weight).abs().le(step / 2 + 1e-6).all()
    assert unpack_int4(int4.values).max() <= 15


def test_the_quantization_setting_names_its_quantizer() -> None:
    assert quantizer("none") is None
    assert quantizer("int8")(torch.randn(4, 8)).format == "int8"
    assert quantizer("int4", 64)(torch.randn(4, 64)).group_size == 64
    with pytest.raises(ValueError, match="int4 groups"):
        quantizer("int4", 48)


def test_the_selection_chooses_and_names_how_quantized_products_run(monkeypatch) -> None:
    """Compiled where the kernels build (auto), dequantizing with `torch` or where they do not;
    the reason the worker logs says which, and why."""
    weight = quantize_int8(torch.randn(8, 16))
    compiled_kernels()
    chosen = select_backend("auto", "cpu", torch.float32, 16, quantization="int8")
    assert isinstance(chosen.backend.pack(weight), CompiledQuantLinear)
    assert "int8: quantized weights by the compiled AVX2 kernels" in chosen.reason
    reference = select_backend("torch", "cpu", torch.float32, 16, quantization="int8")
    assert type(reference.backend.pack(weight)) is DequantizingLinear
    assert "int8: quantized weights dequantized for each product (PyTorch) (asked for (torch))" in reference.reason
    monkeypatch.setattr(quant_kernels, "load", lambda: None)
    monkeypatch.setattr(quant_kernels, "failure", lambda: "this CPU lacks avx2")
    fallback = select_backend("auto", "cpu", torch.float32, 16, quantization="int4")
    assert type(fallback.backend.pack(quantize_int4(torch.randn(8, 32)))) is DequantizingLinear
    assert fallback.reason.endswith("int4: quantized weights dequantized for each product (PyTorch) "
                                    "(this CPU lacks avx2)")
    assert "quantized" not in select_backend("auto", "cpu", torch.float32, 16).reason
