"""Quantized products over activations quantized to 8 bits (`--activation-quantization int8`,
`csrc/quant_gemv_int8.cpp`): against PyTorch's float32 product over the dequantized weight of
the activations quantized per block of 32 columns as the kernel does (`quantize_blocks` below,
the reference), within float32 tolerance, for 1-9, 16 and 31-32 rows and odd numbers of groups; against the
exact float32 product within the rounding that quantization costs; products it does not take
(more rows, other layouts) unchanged; greedy decoding through the worker's runner with the flag
(the compiled layer and the module path) against the exact products."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker.quant_helpers import FORMATS as QUANT_FORMATS
from worker.quant_helpers import compiled_kernels, exact_product, random_case
from worker.tiny_gguf import write_tiny_gguf
from worker.tiny_models import VOCAB_SIZE, make_tiny_llama
from worker_service.backends import selection
from worker_service.backends.fused_quant_llama import FusedQuantLlamaLayers
from worker_service.backends.linear_quant import GEMV_MAX_ROWS, CompiledQuantLinear
from worker_service.forward_batch import ForwardEntry
from worker_service.model_runner import ModelRunner, RunnerConfig
from worker_service.quant.format import QuantizedWeight, quantize_int4, quantize_int8

BLOCK = 32
# Each product sums K <= 600 terms in float32 in another order than the float64 reference.
RTOL, ATOL = 1e-5, 1e-4
# Against the exact product: each activation moves by at most half a step (max|x| / 254 in its
# block). Measured over these shapes and rows, the relative error (the norm of the difference over
# the norm of the exact output, biases included) is at most 0.55%; 2% bounds it.
EXACT_RTOL = 0.02

# Every shared format but groups of 128 (two spans, nothing the others do not reach here).
FORMATS = {name: make for name, make in QUANT_FORMATS.items() if name != "int4-g128"}
# (N, K): an odd number of blocks of 32 (7, 15, 9), and for int4 K off the blocks (257, 40).
SHAPES = {"int8": [(37, 224), (130, 480), (5, 96)], "int4": [(37, 224), (130, 576), (77, 257), (3, 40)]}
# Every tile shape of four rows and its remainders, and the kernel's largest products.
ROWS = [*range(1, 10), 16, GEMV_MAX_ROWS - 1, GEMV_MAX_ROWS]


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
    return exact_product(quantize_blocks(x), weight, bias)


def cases():
    for name in FORMATS:
        for shape in SHAPES[name[:4]]:
            yield name, shape


@pytest.mark.parametrize(("name", "shape"), list(cases()), ids=str)
def test_products_equal_the_product_over_activations_quantized_per_block(name, shape) -> None:
    n, k = shape
    weight, bias, generator = random_case(name, n, k)
    kernels = compiled_kernels()
    linear = CompiledQuantLinear(kernels, weight, bias, False, int8_activations=True)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=generator)
        x[0, : min(k, BLOCK)] = 0.0  # a block of zeros: d = 0
        got = linear(x)
        torch.testing.assert_close(got, reference(x, weight, bias), rtol=RTOL, atol=ATOL, msg=f"{rows} rows")
        exact = exact_product(x, weight, bias)
        error = (got - exact).norm() / exact.norm()
        assert error < EXACT_RTOL, f"{rows} rows: relative error {error:.4f} against the float32 product"


@pytest.mark.parametrize(("name", "shape"), list(cases()), ids=str)
def test_a_row_gets_the_same_bits_alone_and_among_others(name, shape) -> None:
    """The kernel takes several rows and (int4) several output features a pass, each (row,
    feature) sum accumulated as alone: every row of a product of up to 32 rows is the same bits as
    that row's product alone, and every feature the same as in a product of that feature alone."""
    n, k = shape
    weight, bias, generator = random_case(name, n, k)
    kernels = compiled_kernels()
    linear = CompiledQuantLinear(kernels, weight, bias, False, int8_activations=True)
    x = torch.randn(GEMV_MAX_ROWS, k, generator=generator)
    alone = torch.cat([linear(x[r:r + 1]) for r in range(GEMV_MAX_ROWS)])
    for rows in ROWS:
        assert torch.equal(linear(x[:rows]), alone[:rows]), f"{rows} rows"
    feature = n - 1  # the last feature: past the passes of several features where n is not a multiple
    one = QuantizedWeight(weight.format, weight.values[feature:], weight.scales[feature:],
                          None if weight.offsets is None else weight.offsets[feature:], weight.group_size, k)
    single = CompiledQuantLinear(kernels, one, None if bias is None else bias[feature:], False, int8_activations=True)
    assert torch.equal(single(x[:1]), alone[:1, feature:])


def test_more_rows_and_layouts_it_does_not_take_are_the_float32_products() -> None:
    """Past `GEMV_MAX_ROWS` rows (prefill) the product is the float32 one over the dequantized
    weight; so is an int8 weight whose K is not a multiple of 32 (the kernel leaves it)."""
    kernels = compiled_kernels()
    generator = torch.Generator().manual_seed(7)
    for weight, rows in ((quantize_int4(torch.randn(40, 100, generator=generator)), GEMV_MAX_ROWS + 1),
                         (quantize_int8(torch.randn(40, 100, generator=generator), 16), 3)):
        x = torch.randn(rows, weight.in_features, generator=generator)
        got = CompiledQuantLinear(kernels, weight, None, True, int8_activations=True)(x)
        exact = exact_product(x, weight, None)
        torch.testing.assert_close(got, exact, rtol=RTOL, atol=ATOL)
        assert not torch.allclose(got, reference(x, weight, None), rtol=RTOL, atol=ATOL)


# --- Through the worker's runner (a tiny random Llama, int4 layers, the LM head's int8 copy) ---

PAGE_SIZE = 4
KV_BYTES = 1 << 20
NUM_TOKENS = 6
# Logits of the int8-activation runner against the exact one, relative to the largest logit: each
# product's activations move by up to half a step of their block (max|x| / 254; about 0.5% of
# their norm for Gaussian blocks), through two layers' eight products and the head. Measured on
# this model (hidden 96: few, large terms per output) over 3 prompt sets x 6 steps: 1.0-2.2%; 4%.
LOGITS_RTOL = 0.04
# The compiled layer against the module path, both with int8 activations: the same arithmetic
# but for float32 rounding before each quantization, which can move a value across a rounding
# boundary (one step, max|x| / 127, in one activation). Measured: equal in 17 of those 18 steps,
# 0.9% in one; 2%.
PATHS_RTOL = 0.02


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-int8-activations"))


def runner(model_dir: Path, activations: str, **overrides) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=model_dir, page_size=PAGE_SIZE, kv_cache_bytes=KV_BYTES,
                                    quantization="int4", lm_head_quantization="int8",
                                    activation_quantization=activations, **overrides))


def test_greedy_decode_with_int8_activations_stays_close_to_the_exact_products(tiny_llama, monkeypatch) -> None:
    """Greedy decoding of the exact runner, replayed token by token through a runner with int8
    activations on the compiled layer and one on the module path: their logits within the
    rounding the activations' quantization costs (`LOGITS_RTOL`) of the exact ones, and within
    float32 rounding before it (`PATHS_RTOL`) of each other."""
    compiled_kernels()
    monkeypatch.setattr(selection, "native_refusal", lambda *args: "refused by the test (as without AVX-512)")
    exact, fused, module = runner(tiny_llama, "none"), runner(tiny_llama, "int8"), runner(tiny_llama, "int8")
    assert isinstance(fused.fused, FusedQuantLlamaLayers), fused.backend_reason
    module.fused = None
    assert fused.info.quantization == "int4-g32+lm_head:int8+activations:int8"
    assert "activations rounded to int8" in fused.backend_reason
    prompts = [torch.randint(3, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(length)).tolist()
               for length in (9, 5)]
    tables = [[7, 2, 11, 4], [3, 9, 1, 6]]
    tokens: list[list[int]] = [[], []]
    for run in (exact, fused, module):
        logits = run.forward([ForwardEntry(p, 0, t, True) for p, t in zip(prompts, tables)])
        if run is exact:
            tokens = [[int(row.argmax())] for row in logits]
    worst = 0.0
    for step in range(NUM_TOKENS):
        rows = [0] if step % 2 else [0, 1]  # one row, then both
        entries = [ForwardEntry([tokens[i][-1]], len(prompts[i]) + len(tokens[i]) - 1, tables[i], True)
                   for i in rows]
        expected, got, by_modules = exact.forward(entries), fused.forward(entries), module.forward(entries)
        scale = float(expected.abs().max())
        worst = max(worst, float((got - expected).abs().max()) / scale)
        torch.testing.assert_close(got, expected, atol=LOGITS_RTOL * scale, rtol=0)
        torch.testing.assert_close(got, by_modules, atol=PATHS_RTOL * scale, rtol=0)
        for i, row in zip(rows, expected):
            tokens[i].append(int(row.argmax()))
    assert worst > 0.0  # the activations were rounded: not the exact products


def test_int8_activations_are_refused_where_they_cannot_run(tiny_llama) -> None:
    with pytest.raises(ValueError, match="--activation-quantization int8 needs quantized decoder weights"):
        ModelRunner(RunnerConfig(model_dir=tiny_llama, kv_cache_bytes=KV_BYTES, activation_quantization="int8"))
    with pytest.raises(RuntimeError, match="--activation-quantization int8: the compiled quantized kernels"):
        runner(tiny_llama, "int8", attention_kernel="torch")


def test_auto_rounds_a_gguf_files_activations_and_nothing_else(tiny_llama, tmp_path) -> None:
    """`auto` (the default) takes int8 activations for a GGUF file's weights where the compiled
    kernels run, as llama.cpp multiplies them, and float32 ones for weights quantized at load
    time, with the PyTorch reference backend, and for plain weights; what it chose is in the
    served quantization. A GGUF runner's default logits stay within the rounding of the
    activations of its exact ones (`LOGITS_RTOL`), and are not those."""
    compiled_kernels()
    path = write_tiny_gguf(tmp_path / "tiny-Q4_1.gguf", "Q4_1")
    config = dict(model_dir=path, page_size=PAGE_SIZE, kv_cache_bytes=KV_BYTES)
    default = ModelRunner(RunnerConfig(**config))
    exact = ModelRunner(RunnerConfig(**config, activation_quantization="none"))
    reference_backend = ModelRunner(RunnerConfig(**config, attention_kernel="torch"))
    assert RunnerConfig(model_dir=path).activation_quantization == "auto"
    assert default.int8_activations and default.info.quantization.endswith("+activations:int8")
    assert not exact.int8_activations and "activations" not in exact.info.quantization
    assert not reference_backend.int8_activations and "activations" not in reference_backend.info.quantization
    assert not runner(tiny_llama, "auto").int8_activations
    assert not ModelRunner(RunnerConfig(model_dir=tiny_llama, kv_cache_bytes=KV_BYTES)).int8_activations
    prompt = torch.randint(3, VOCAB_SIZE, (9,), generator=torch.Generator().manual_seed(9)).tolist()
    entries = [ForwardEntry(prompt, 0, [7, 2, 11], True)]
    expected, got = exact.forward(entries), default.forward(entries)
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, atol=LOGITS_RTOL * scale, rtol=0)
    assert not torch.equal(got, expected)
