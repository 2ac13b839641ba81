"""Pre-quantized GPTQ and AWQ int4 checkpoints served with their int4 weights kept: each layout
stands for exactly the weights the format's spec dequantizes, and a tiny random Llama in each
format gives transformers' logits and greedy tokens, transformers loading the same weights
dequantized into a plain checkpoint (it cannot load these formats without packages we do not
install). What is not supported is refused at load, naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from worker.tiny_models import assert_matches_reference
from worker.tiny_prequantized import dequantize, pack, quantize, write_prequantized
from worker_service.quant.prequantized import awq_weight, gptq_weight, prequantized_scheme
from worker_service.unsupported import UnsupportedModel

PROMPT_IDS = list(range(3, 40))
NUM_NEW_TOKENS = 8
# (method, group size, symmetric, GPTQ checkpoint format)
CASES = {
    "gptq-sym-g128": ("gptq", 128, True, "gptq"),
    "gptq-asym-g32": ("gptq", 32, False, "gptq"),
    "gptq_v2-asym-g64": ("gptq", 64, False, "gptq_v2"),
    "awq-g64": ("awq", 64, False, "gptq"),
}


def _scheme(method: str, group: int, sym: bool, checkpoint_format: str):
    class Config:
        quantization_config = {"quant_method": method, "bits": 4, "group_size": group, "sym": sym,
                               "checkpoint_format": checkpoint_format}
    return prequantized_scheme(Config())


def _as_torch(tensors: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array) for name, array in tensors.items()}


@pytest.mark.parametrize("case", CASES)
def test_each_layout_stands_for_exactly_the_weights_its_spec_dequantizes(case) -> None:
    method, group, sym, checkpoint_format = CASES[case]
    zeros_minus_one = method == "gptq" and checkpoint_format == "gptq"
    rows, cols = 24, 256  # outputs a multiple of 8 (packed zeros), inputs whole groups
    weight = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    packed = pack(method, *quantize(weight, group, sym, min_zero=1 if zeros_minus_one else 0), group,
                  zeros_minus_one)
    scheme = _scheme(method, group, sym, checkpoint_format)
    t = _as_torch(packed)
    ours = gptq_weight(scheme, t["qweight"], t["qzeros"], t["scales"], t["g_idx"]) if method == "gptq" else \
        awq_weight(scheme, t["qweight"], t["qzeros"], t["scales"])
    expected = torch.from_numpy(dequantize(method, packed, zeros_minus_one))
    assert torch.equal(ours.dequantize(), expected)
    # The weights are the RTN quantization of `weight`: within half a step of it.
    assert float((expected - torch.from_numpy(weight)).abs().max()) < 0.5
    # Tensor-parallel shards: whole rows, and columns on group boundaries.
    assert torch.equal(ours.rows(range(8, 19)).dequantize(), expected[8:19])
    assert torch.equal(ours.cols(range(128, cols)).dequantize(), expected[:, 128:])


def test_a_gptq_g_idx_of_act_order_is_refused() -> None:
    weight = np.random.default_rng(2).standard_normal((16, 128)).astype(np.float32)
    t = _as_torch(pack("gptq", *quantize(weight, 32, True, min_zero=1), 32, True))
    scheme = _scheme("gptq", 32, True, "gptq")
    with pytest.raises(UnsupportedModel, match="act-order"):
        gptq_weight(scheme, t["qweight"], t["qzeros"], t["scales"], t["g_idx"].flip(0))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("prequantized")
    return {case: write_prequantized(root / case, method, group, sym, checkpoint_format)
            for case, (method, group, sym, checkpoint_format) in CASES.items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES)
def test_tiny_checkpoint_matches_transformers_on_its_dequantized_weights(checkpoints, case) -> None:
    from transformers import AutoModelForCausalLM

    from worker_service.model_runner import ModelRunner, RunnerConfig

    method, group = CASES[case][:2]
    quantized, plain = checkpoints[case]
    reference = AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32).eval()
    runner = ModelRunner(RunnerConfig(model_dir=quantized, kv_cache_bytes=16 << 20))
    assert runner.info.quantization == f"{method}:int4-g{group}"
    assert_matches_reference(runner, reference, PROMPT_IDS, NUM_NEW_TOKENS)
    # The linear weights stayed int4: the model holds well under its float32 bytes.
    cfg = reference.config
    linear_params = cfg.num_hidden_layers * (
        (2 * cfg.hidden_size + 2 * cfg.num_key_value_heads * cfg.head_dim) * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size)
    dense_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    assert runner.weight_bytes() < dense_bytes - linear_params * 4 * 0.6


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "bitsandbytes"}, r"pre-quantized checkpoints \(bitsandbytes\) are not supported"),
    ({"bits": 8}, "gptq checkpoints of 8 bits are not supported"),
    ({"group_size": 48}, "gptq group_size 48 is not supported"),
    ({"group_size": -1}, "gptq group_size -1 is not supported"),
    ({"desc_act": True}, r"act-order \(desc_act: true\)"),
    ({"checkpoint_format": "marlin"}, "gptq checkpoint_format 'marlin' is not supported"),
    ({"quant_method": "awq", "version": "gemv"}, "awq version 'gemv' is not supported"),
    ({"quant_method": "awq", "zero_point": False}, r"zero_point: false"),
])
def test_what_is_not_supported_is_refused_at_load_naming_it(checkpoints, tmp_path, change, message) -> None:
    from worker_service.model_runner import ModelRunner, RunnerConfig

    model_dir = tmp_path / "model"
    shutil.copytree(checkpoints["gptq-sym-g128"][0], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"].update(change)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match=message):
        ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_bytes=1 << 20))
