"""Whole tiny models with `--quantization`: the logits of transformers' model whose decoder linear
weights are replaced by their quantized-then-dequantized values (the exact reference: the product
over the dequantized weight), and greedy tokens against transformers at float32; on the PyTorch
reference (dequantizing) and with the compiled AVX2 kernels (auto, where they build)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from worker.tiny_models import VOCAB_SIZE, greedy_tokens, make_tiny_llama, make_tiny_qwen2, reference_greedy
from worker_service.backends.linear_quant import CompiledQuantLinear, DequantizingLinear
from worker_service.config import parse_config
from worker_service.forward_batch import ForwardEntry
from worker_service.model_runner import ModelRunner, RunnerConfig
from worker_service.quant import kernels as quant_kernels
from worker_service.quant.scheme import quantizer
from worker_service.server import load_executor

# float32 products over the same dequantized weights, summed in another order (2 layers).
ATOL = 1e-4
PAGE_SIZE = 4
KV_BYTES = 1 << 20
PROMPT_LEN = 21
NUM_TOKENS = 8
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def prompt() -> list[int]:
    return torch.randint(3, VOCAB_SIZE, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()


def dequantized_reference(model_dir: Path, quantization: str) -> torch.nn.Module:
    """transformers' model with each decoder linear weight quantized and dequantized in place."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    quantize = quantizer(quantization)
    with torch.no_grad():
        for name, module in model.model.layers.named_modules():
            if name.rsplit(".", 1)[-1] in DECODER_LINEARS:
                module.weight.copy_(quantize(module.weight).dequantize())
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return (make_tiny_llama if request.param == "llama" else make_tiny_qwen2)(out_dir)


@pytest.mark.parametrize("kernel", ["torch", "auto"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_model_matches_transformers_over_dequantized_weights(model_dir, quantization, kernel) -> None:
    if kernel == "auto" and quant_kernels.load() is None:
        pytest.skip(f"the quantized kernels do not build here: {quant_kernels.failure()}")
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, page_size=PAGE_SIZE, kv_cache_bytes=KV_BYTES,
                                      attention_kernel=kernel, quantization=quantization))
    packed = runner.model.layers[0].mlp.down_proj.packed
    assert type(packed) is (DequantizingLinear if kernel == "torch" else CompiledQuantLinear)
    assert f"{quantization}: quantized weights" in runner.backend_reason
    reference = dequantized_reference(model_dir, quantization)
    token_ids = prompt()
    with torch.no_grad():
        expected = reference(torch.tensor([token_ids])).logits[0]
    pages = list(range(20, 30))
    prefill = runner.forward([ForwardEntry(token_ids[:-3], 0, pages, True)])  # a prefill past GEMV_MAX_ROWS
    torch.testing.assert_close(prefill[0], expected[-4], atol=ATOL, rtol=0)
    for position in range(PROMPT_LEN - 3, PROMPT_LEN):  # decode steps: the in-register kernel
        logits = runner.forward([ForwardEntry([token_ids[position]], position, pages, True)])
        torch.testing.assert_close(logits[0], expected[position], atol=ATOL, rtol=0)
    assert greedy_tokens(runner, token_ids, NUM_TOKENS, list(range(40, 50))) == \
        reference_greedy(reference, token_ids, NUM_TOKENS)


def test_int8_gives_float32s_greedy_tokens(model_dir) -> None:
    """int8 per channel against the unquantized float32 model: the same greedy tokens on a short prompt."""
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, page_size=PAGE_SIZE, kv_cache_bytes=KV_BYTES,
                                      quantization="int8"))
    float32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    token_ids = prompt()
    assert greedy_tokens(runner, token_ids, NUM_TOKENS, list(range(10))) == \
        reference_greedy(float32, token_ids, NUM_TOKENS)


@pytest.mark.parametrize("kernel", ["torch", "auto"])
def test_an_int8_lm_head_gives_transformers_logits_over_its_dequantized_copy(model_dir, kernel) -> None:
    """--lm-head-quantization int8 beside int4 decoder weights: transformers' model with both
    quantized and dequantized in place (its head untied: the embeddings stay as they were)."""
    if kernel == "auto" and quant_kernels.load() is None:
        pytest.skip(f"the quantized kernels do not build here: {quant_kernels.failure()}")
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, page_size=PAGE_SIZE, kv_cache_bytes=KV_BYTES,
                                      attention_kernel=kernel, quantization="int4", lm_head_quantization="int8"))
    assert isinstance(runner.model.lm_head.packed, DequantizingLinear)  # the compiled kernel's class too
    assert runner.info.quantization == "int4-g32+lm_head:int8"
    head = runner.model.lm_head
    assert head.copy_bytes == head.weight.numel()  # one byte per weight, counted in weight_bytes()
    reference = dequantized_reference(model_dir, "int4")
    with torch.no_grad():
        head = quantizer("int8")(reference.lm_head.weight.detach()).dequantize()
        reference.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    token_ids = prompt()
    with torch.no_grad():
        expected = reference(torch.tensor([token_ids])).logits[0]
    prefill = runner.forward([ForwardEntry(token_ids[:-3], 0, list(range(20, 30)), True)])
    torch.testing.assert_close(prefill[0], expected[-4], atol=ATOL, rtol=0)
    assert greedy_tokens(runner, token_ids, NUM_TOKENS, list(range(40, 50))) == \
        reference_greedy(reference, token_ids, NUM_TOKENS)


def test_an_int8_lm_head_needs_quantized_decoder_weights(model_dir) -> None:
    with pytest.raises(ValueError, match="--lm-head-quantization int8 needs quantized decoder weights"):
        ModelRunner(RunnerConfig(model_dir=model_dir, page_size=PAGE_SIZE, kv_cache_bytes=KV_BYTES,
                                 lm_head_quantization="int8"))


def test_embedding_and_lm_head_stay_in_the_model_dtype(model_dir) -> None:
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, page_size=PAGE_SIZE, kv_cache_bytes=KV_BYTES,
                                      quantization="int4"))
    assert runner.model.embed_tokens.weight.dtype == torch.float32
    assert not isinstance(runner.model.lm_head.packed, DequantizingLinear)


@pytest.mark.parametrize(("flags", "served"), [(["--quantization", "int4", "--quantization-group-size", "64"],
                                                "int4-g64"),
                                               ([], "none")])
def test_the_worker_reports_its_quantization(flags, served, tmp_path, caplog) -> None:
    """GetWorkerInfo (and so the router's GetModelInfo and /v1/models), the metrics and the log
    line say which quantization is served, and how its products run."""
    model_dir = make_tiny_llama(tmp_path / "model")  # with the tokenizer rank 0's constraints need
    config = parse_config(["--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--page-size", "4",
                           "--kv-cache-mb", "1", *flags], env={})
    with caplog.at_level(logging.INFO, logger="worker_service"):
        executor = load_executor(config)
    assert executor.runner.info.quantization == served
    assert executor.metrics.registry.get_sample_value(
        "radixserve:worker_quantization_info",
        {"model_name": model_dir.name, "rank": "0", "quantization": served}) == 1
    logged = any(f"{config.quantization}: quantized weights" in record.getMessage() for record in caplog.records)
    assert logged == (served != "none")
