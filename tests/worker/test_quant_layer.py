"""The compiled decoder layer for quantized weights (`backends/fused_quant_llama.py`) against the
PyTorch backend's module path over the same quantized weights: logits of decode steps (one row and
several rows of different lengths and scattered pages) within float32 rounding and the same greedy
tokens in float32, within bfloat16's rounding in bfloat16; and where the selection takes it.

The layer is chosen where the main compiled library does not run (no AVX-512); on a machine where
it does, the tests make the selection see it refused, as on such a CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.tiny_models import VOCAB_SIZE, make_tiny_llama, make_tiny_qwen2
from worker_service.backends import selection
from worker_service.backends.fused_quant_llama import FusedQuantLlamaLayers
from worker_service.backends.quant_layers_backend import QuantLayersBackend
from worker_service.backends.torch_backend import TorchBackend
from worker_service.forward_batch import ForwardEntry
from worker_service.model_runner import ModelRunner, RunnerConfig
from worker_service.native import quant_layer_kernels
from worker_service.quant import kernels as quant_kernels

PAGE_SIZE = 4
KV_BYTES = 1 << 20
NUM_TOKENS = 4
# Relative to the largest logit: float32 sums in another order over 2 layers; in bfloat16 the
# PyTorch path rounds between its ops and the compiled layer does not.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 5e-2}

pytestmark = pytest.mark.skipif(
    quant_kernels.load() is None or quant_layer_kernels.load() is None,
    reason=f"the compiled quantized kernels do not build here: "
           f"{quant_kernels.failure() or quant_layer_kernels.failure()}")


@pytest.fixture(autouse=True)
def without_main_library(monkeypatch) -> None:
    """The selection sees the main compiled library refused, as on a CPU without AVX-512."""
    monkeypatch.setattr(selection, "native_refusal", lambda *args: "refused by the test (as without AVX-512)")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return (make_tiny_llama if request.param == "llama" else make_tiny_qwen2)(out_dir)


def runners(model_dir: Path, quantization: str, dtype: str) -> tuple[ModelRunner, ModelRunner]:
    """(a runner taking the compiled layer, one of the same backend taking the module path)."""
    made = []
    for _ in range(2):
        made.append(ModelRunner(RunnerConfig(model_dir=model_dir, dtype=dtype, page_size=PAGE_SIZE,
                                             kv_cache_bytes=KV_BYTES, quantization=quantization)))
    fused, module = made
    assert isinstance(fused.backend, QuantLayersBackend) and isinstance(fused.fused, FusedQuantLlamaLayers)
    assert "compiled AVX2 layer" in fused.backend_reason
    module.fused = None
    return fused, module


def assert_close(fused: torch.Tensor, module: torch.Tensor, dtype: torch.dtype) -> None:
    scale = float(module.abs().max())
    torch.testing.assert_close(fused, module, atol=TOLERANCE[dtype] * scale, rtol=0)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# Each model in both formats in float32; bfloat16 (the pool's K/V rounded on write) in int4 alone;
# the layer's threaded parts (attention's heads, the products' features) on 2 threads once.
@pytest.mark.parametrize(("quantization", "dtype", "num_threads"), [("int4", "float32", 2), ("int8", "float32", 1),
                                                                    ("int4", "bfloat16", 1)])
def test_compiled_layer_matches_module_path(model_dir, quantization, dtype, num_threads) -> None:
    saved = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        compare_decode_steps(model_dir, quantization, dtype)
    finally:
        torch.set_num_threads(saved)


def compare_decode_steps(model_dir: Path, quantization: str, dtype: str) -> None:
    fused, module = runners(model_dir, quantization, dtype)
    torch_dtype = getattr(torch, dtype)
    # Three sequences of different lengths on scattered pages (page ids out of order).
    tables = [[9, 3, 17, 5, 12, 30], [2, 25, 8, 14, 40, 1], [33, 6, 21, 11, 35, 28]]
    prompts = [prompt(length, seed) for seed, length in enumerate((9, 14, 5))]
    tokens = [[], [], []]
    for runner in (fused, module):
        logits = runner.forward([ForwardEntry(p, 0, t, True) for p, t in zip(prompts, tables)])
        if runner is module:
            tokens = [[int(row.argmax())] for row in logits]
    for _ in range(NUM_TOKENS):
        # One row alone (the first sequence), then all three together.
        for rows in ([0], [0, 1, 2]):
            entries = [ForwardEntry([tokens[i][-1]], len(prompts[i]) + len(tokens[i]) - 1, tables[i], True)
                       for i in rows]
            expected = module.forward(entries)
            got = fused.forward(entries)
            assert_close(got, expected, torch_dtype)
            if torch_dtype == torch.float32:
                assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
            for i, row in zip(rows, expected):
                tokens[i].append(int(row.argmax()))


def test_selection_takes_the_layer_only_for_auto_with_quantized_weights(model_dir) -> None:
    """`torch` is the reference (no compiled layer); unquantized weights keep the plain PyTorch backend."""
    for kernel, quantization in (("torch", "int4"), ("auto", "none")):
        runner = ModelRunner(RunnerConfig(model_dir=model_dir, page_size=PAGE_SIZE, kv_cache_bytes=KV_BYTES,
                                          attention_kernel=kernel, quantization=quantization))
        assert "compiled AVX2 layer" not in runner.backend_reason
        assert type(runner.backend) is TorchBackend and runner.fused is None, (kernel, quantization)


# A step's threads split the products' output features and attention's (row, head) pairs, never a
# sum, and meet at barriers that spin and then sleep: the logits are the same bits on 1 thread, on
# 2, and on 3 (more threads than this machine's cores: the barriers' sleeping path).
@pytest.mark.parametrize("activations", ["none", "int8"])
def test_compiled_layer_gives_the_same_bits_on_any_number_of_threads(model_dir, activations) -> None:
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, page_size=PAGE_SIZE, kv_cache_bytes=KV_BYTES,
                                      quantization="int4", activation_quantization=activations))
    assert isinstance(runner.fused, FusedQuantLlamaLayers)
    tables = [[9, 3, 17, 5, 12, 30], [2, 25, 8, 14, 40, 1], [33, 6, 21, 11, 35, 28]]
    prompts = [prompt(length, seed) for seed, length in enumerate((9, 14, 5))]
    logits = runner.forward([ForwardEntry(p, 0, t, True) for p, t in zip(prompts, tables)])
    tokens = [[int(row.argmax())] for row in logits]
    saved = torch.get_num_threads()
    try:
        for _ in range(NUM_TOKENS):
            entries = [ForwardEntry([tokens[i][-1]], len(prompts[i]) + len(tokens[i]) - 1, tables[i], True)
                       for i in range(3)]
            by_threads = {}
            for threads in (1, 2, 3):  # each run writes the same K/V into the same slots
                torch.set_num_threads(threads)
                by_threads[threads] = runner.forward(entries)
            assert torch.isfinite(by_threads[1]).all()
            assert torch.equal(by_threads[2], by_threads[1]) and torch.equal(by_threads[3], by_threads[1])
            for i, row in enumerate(by_threads[1]):
                tokens[i].append(int(row.argmax()))
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize(("quantization", "dtype"), [("int4", "float32"), ("int8", "float32"), ("int4", "bfloat16")])
def test_compiled_layer_takes_prefill_and_verify_steps_of_up_to_32_tokens(model_dir, quantization, dtype) -> None:
    """Steps with several tokens of one request (a prompt's first chunk, a next chunk after cached
    positions, a speculative verify step of 1 + k tokens, beside decode rows) run on the compiled
    layer, each token a row attending up to its own position: every position's logits equal the
    module path's within the layer's rounding; a step of more tokens takes the module path."""
    fused, module = runners(model_dir, quantization, dtype)
    torch_dtype = getattr(torch, dtype)
    taken = []
    applies = fused.fused.applies
    fused.fused.applies = lambda step: taken.append(applies(step)) or taken[-1]
    tables = [[9, 3, 17, 5, 12, 30, 7, 22, 44], [2, 25, 8, 14, 40, 1, 19, 36, 27]]
    first, second = prompt(11, 0), prompt(6, 1)
    steps = [
        # A prompt's first chunk (11 tokens over three pages) and another's (6), logits of every position.
        [ForwardEntry(first, 0, tables[0], True, num_logits=11), ForwardEntry(second, 0, tables[1], True, 6)],
        # A verify step: 1 + 4 tokens after 11 cached positions (crossing a page), beside a decode row.
        [ForwardEntry(prompt(5, 2), 11, tables[0], True, num_logits=5), ForwardEntry(prompt(1, 3), 6, tables[1], True)],
        # A next chunk of 7 after the first request's 16 positions.
        [ForwardEntry(prompt(7, 4), 16, tables[0], True, num_logits=7)],
    ]
    for entries in steps:
        expected, got = module.forward(entries), fused.forward(entries)
        assert got.shape == expected.shape and got.shape[0] == sum(e.num_logits for e in entries)
        assert_close(got, expected, torch_dtype)
        if torch_dtype == torch.float32:
            assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
    assert taken == [True, True, True]
    long = [ForwardEntry(prompt(33, 5), 0, [3, 17, 5, 12, 30, 7, 22, 44, 10], True)]
    assert_close(fused.forward(long), module.forward(long), torch_dtype)
    assert taken[-1] is False  # 33 tokens: the module path
