"""GPT-OSS beyond the family suite (`test_model_families.py` runs its plain checkpoint on every
backend and at TP=2): its released form, experts in MXFP4 blocks, against transformers reading the
same file with its own dequantization; the attention sinks on the deterministic backend; what is
refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from worker.families import VOCAB_SIZE, make_family
from worker.mxfp4_checkpoint import make_mxfp4_gpt_oss
from worker.test_model_families import ATOL, require_backend
from worker.tiny_models import greedy_logits_and_reference
from worker_service.backends.base import ATTENTION_SINKS
from worker_service.backends.selection import select_backend
from worker_service.forward_batch import ForwardEntry
from worker_service.model_runner import ModelRunner, RunnerConfig
from worker_service.models.gpt_oss import GptOssForCausalLM
from worker_service.quant.mxfp4 import mxfp4_weight
from worker_service.unsupported import UnsupportedModel

pytestmark = pytest.mark.timeout(300)
PAGE_SIZE = 4
PROMPT_LEN = 37
DECODE_STEPS = 8


def prompt() -> list[int]:
    return torch.randint(3, VOCAB_SIZE, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()


def reference(model_dir: Path) -> torch.nn.Module:
    quantized = "mxfp4" in model_dir.name
    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if quantized else {}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **extra).eval()


def served_and_expected(runner: ModelRunner, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The runner's logits of the prompt and `DECODE_STEPS` greedy steps, transformers' over the
    same tokens, and the greedy tokens."""
    return greedy_logits_and_reference(runner, model, prompt(), DECODE_STEPS, list(range(20))[::-1])


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory) -> Path:
    return make_mxfp4_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))


def test_mxfp4_blocks_are_transformers_dequantization_exactly() -> None:
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(100, 160, (3, 40, 4), generator=generator, dtype=torch.uint8)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    for expert in range(3):
        weight = mxfp4_weight(blocks[expert], scales[expert], 128)
        assert weight.format == "int8" and weight.group_size == 32
        assert torch.equal(weight.dequantize(), expected[expert].T)


@pytest.mark.parametrize("kernel", ("torch", "native"))
def test_an_mxfp4_checkpoint_is_served_as_transformers_reads_it(mxfp4_dir, kernel) -> None:
    require_backend(kernel)
    runner = ModelRunner(RunnerConfig(model_dir=mxfp4_dir, page_size=PAGE_SIZE, kv_cache_bytes=1 << 21,
                                      attention_kernel=kernel))
    assert runner.info.quantization == "mxfp4:int8-g32"
    moe = runner.model.layers[0].mlp
    assert moe.gate_up[0].weight.dtype == moe.down[0].weight.dtype == torch.int8  # kept, not dequantized
    logits, expected, tokens = served_and_expected(runner, reference(mxfp4_dir))
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    plain = ModelRunner(RunnerConfig(model_dir=mxfp4_dir.parent / "plain", page_size=PAGE_SIZE,
                                     kv_cache_bytes=1 << 21, attention_kernel=kernel))
    assert runner.weight_bytes() < 0.7 * plain.weight_bytes()


@pytest.mark.timeout(400)
def test_an_mxfp4_checkpoint_at_tp2_keeps_its_groups_whole(tmp_path) -> None:
    """96 intermediate features are 3 groups of 32: the ranks take 64 and 32 (an even split of
    48 would cut a group), and rank 0 adds the down biases once."""
    from worker.test_tensor_parallel import run_ranks

    model_dir = make_mxfp4_gpt_oss(tmp_path / "model", intermediate_size=96)
    first, second = run_ranks(model_dir, prompt(), 2, tmp_path, "torch", timeout_s=300)
    model = reference(model_dir)
    tokens = first["tokens"]
    with torch.no_grad():
        expected = model(torch.tensor([prompt() + tokens[:-1]])).logits[0, PROMPT_LEN - 1:]
    torch.testing.assert_close(first["step_logits"], expected, atol=ATOL, rtol=0)
    assert second["step_logits"] is None


def test_the_deterministic_backend_attends_with_the_sinks(tmp_path) -> None:
    model_dir = make_family("gpt_oss", tmp_path / "plain")
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, page_size=PAGE_SIZE, kv_cache_bytes=1 << 21,
                                      attention_kernel="torch", deterministic=True, dtype="float32"))
    logits, expected, _ = served_and_expected(runner, reference(model_dir))
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_what_is_refused_or_named(tmp_path) -> None:
    from transformers import AutoConfig

    model_dir = make_family("gpt_oss", tmp_path / "plain", attention_bias=False)
    with pytest.raises(UnsupportedModel, match="attention_bias=False"):
        ModelRunner(RunnerConfig(model_dir=model_dir, page_size=PAGE_SIZE, kv_cache_bytes=1 << 21,
                                 attention_kernel="torch"))
    ops = GptOssForCausalLM.ops_without_kernels(AutoConfig.from_pretrained(model_dir))
    assert ATTENTION_SINKS in ops
    require_backend("native")  # whose kernel computes the sinks: its reason lists the rest only
    reason = select_backend("native", "cpu", torch.float32, 16, ops_without_kernels=ops).reason
    assert "sliding-window attention, mixture-of-experts routing in PyTorch's ops" in reason
    assert ATTENTION_SINKS not in reason


def test_the_compiled_kernel_attends_with_sinks_and_the_sliding_layers_past_their_window_do_not(
        tmp_path, monkeypatch) -> None:
    """On the compiled backend a full layer's sinks are the kernel's (no per-sequence path), and
    so are a sliding layer's while no sequence outgrows its window; a sliding layer a sequence
    outgrows takes PyTorch's ops (`windowed.py`). All at transformers' logits."""
    from worker_service.attention import windowed
    from worker_service.backends import row_kernels

    require_backend("native")
    calls = []
    monkeypatch.setattr(row_kernels, "windowed_attention",
                        lambda *args, **kwargs: calls.append(1) or windowed.windowed_attention(*args, **kwargs))
    model_dir = make_family("gpt_oss", tmp_path / "plain")  # 3 layers: sliding (8), full, sliding
    model = reference(model_dir)
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, page_size=PAGE_SIZE, kv_cache_bytes=1 << 21,
                                      attention_kernel="native"))
    short = prompt()[:6]
    within = runner.forward([ForwardEntry(short, 0, list(range(4)), True)])[0]
    assert calls == []
    logits, expected, _ = served_and_expected(runner, model)
    assert len(calls) == 2 * (1 + DECODE_STEPS)  # the two sliding layers, every step
    with torch.no_grad():
        torch.testing.assert_close(within, model(torch.tensor([short])).logits[0, -1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_the_pytorch_backend_adds_sinks_to_shared_prefix_and_chunked_attention(tmp_path) -> None:
    """The PyTorch backend's full layers attend with sinks by their log-sum-exps (`with_sinks`):
    two sequences behind one cached 16-token prefix (its pages shared, decoded together: the
    cascade's merge) and a prompt computed in two chunks, at transformers' logits."""
    model_dir = make_family("gpt_oss", tmp_path / "plain")
    model = reference(model_dir)
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, page_size=PAGE_SIZE, kv_cache_bytes=1 << 21,
                                      attention_kernel="torch"))
    tokens = prompt()
    prefix, first, second = tokens[:16], tokens[16:27], tokens[27:]
    shared, pages_a, pages_b = [0, 1, 2, 3], [0, 1, 2, 3, 10, 11, 12, 13], [0, 1, 2, 3, 20, 21, 22, 23, 24]
    runner.forward([ForwardEntry(prefix + first, 0, pages_a, False)])
    runner.forward([ForwardEntry(second[:5], 16, pages_b, False)])  # the second's first chunk, after the prefix
    chunked = runner.forward([ForwardEntry(second[5:], 21, pages_b, True)])[0]
    decoded = runner.forward([ForwardEntry([7], 27, pages_a, True), ForwardEntry([9], 16 + len(second), pages_b, True)])
    assert runner.backend.name == "torch" and shared == pages_a[:4] == pages_b[:4]
    with torch.no_grad():
        expected_b = model(torch.tensor([prefix + second + [9]])).logits[0]
        expected_a = model(torch.tensor([prefix + first + [7]])).logits[0, -1]
    torch.testing.assert_close(chunked, expected_b[-2], atol=ATOL, rtol=0)
    torch.testing.assert_close(decoded[0], expected_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(decoded[1], expected_b[-1], atol=ATOL, rtol=0)
