"""Our Llama and Qwen2 against transformers on tiny random checkpoints (fp32, CPU), on every backend
this machine runs (`backend_params`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from worker.backend_params import backend_params
from worker.tiny_models import VOCAB_SIZE, greedy_tokens, make_tiny_llama, make_tiny_qwen2, reference_greedy
from worker_service.forward_batch import ForwardEntry
from worker_service.model_runner import ModelRunner, RunnerConfig
from worker_service.unsupported import UnsupportedModel

# fp32 on a 2-layer model: measured differences are ~3e-7; 1e-4 leaves room for other CPUs'
# kernels while still catching any real mistake (a wrong RoPE or bias moves logits by >1e-2).
TINY_ATOL = 1e-4
PAGE_SIZE = 4
KV_BYTES = 1 << 20
PROMPT_LEN = 37  # not a multiple of the page size: the last page is partly filled


@pytest.fixture(scope="module", params=backend_params())
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, backend, tmp_path_factory) -> tuple[Path, torch.nn.Module, ModelRunner]:
    out_dir = tmp_path_factory.mktemp(f"tiny-{request.param}")
    (make_tiny_llama if request.param == "llama" else make_tiny_qwen2)(out_dir)
    reference = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    runner = ModelRunner(RunnerConfig(model_dir=out_dir, page_size=PAGE_SIZE, kv_cache_bytes=KV_BYTES,
                                      attention_kernel=backend))
    assert runner.backend.name == backend
    return out_dir, reference, runner


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (length,), generator=generator).tolist()


def reference_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def test_prefill_logits_match_transformers(tiny) -> None:
    _, reference, runner = tiny
    token_ids = prompt(1)
    pages = list(range(10, 20))
    logits = runner.forward([ForwardEntry(token_ids, 0, pages, True)])
    expected = reference_logits(reference, token_ids)[-1]
    assert logits.shape == (1, VOCAB_SIZE) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], expected, atol=TINY_ATOL, rtol=0)


def test_decode_steps_match_transformers_at_every_position(tiny) -> None:
    _, reference, runner = tiny
    token_ids = prompt(2)
    expected = reference_logits(reference, token_ids)
    pages = list(range(30, 40))
    runner.forward([ForwardEntry(token_ids[:5], 0, pages, False)])
    for position in range(5, len(token_ids)):
        logits = runner.forward([ForwardEntry([token_ids[position]], position, pages, True)])
        torch.testing.assert_close(logits[0], expected[position], atol=TINY_ATOL, rtol=0)


def test_batch_of_mixed_entries_matches_transformers(tiny) -> None:
    """Decode tokens of several lengths and prefill chunks in one step, sampled in entry order."""
    _, reference, runner = tiny
    prompts = [prompt(seed, length) for seed, length in [(3, 9), (4, 30), (5, 17), (6, 2)]]
    tables = [list(range(50 + 10 * i, 60 + 10 * i)) for i in range(len(prompts))]
    # Prime the first and third sequence so that they can take a decode step.
    runner.forward([ForwardEntry(prompts[0][:-1], 0, tables[0], False),
                    ForwardEntry(prompts[2][:-1], 0, tables[2], False)])
    entries = [
        ForwardEntry(prompts[0][-1:], len(prompts[0]) - 1, tables[0], True),
        ForwardEntry(prompts[1], 0, tables[1], True),
        ForwardEntry(prompts[2][-1:], len(prompts[2]) - 1, tables[2], False),
        ForwardEntry(prompts[3], 0, tables[3], True),
    ]
    logits = runner.forward(entries)
    assert logits.shape == (3, VOCAB_SIZE)
    for row, index in enumerate([0, 1, 3]):
        expected = reference_logits(reference, prompts[index])[-1]
        torch.testing.assert_close(logits[row], expected, atol=TINY_ATOL, rtol=0)


def test_greedy_continuation_matches_generate(tiny) -> None:
    _, reference, runner = tiny
    token_ids = prompt(7, 12)
    ours = greedy_tokens(runner, token_ids, 32, list(range(100, 112)))
    assert ours == reference_greedy(reference, token_ids, 32)


def test_no_sampled_entry_returns_empty_logits(tiny) -> None:
    _, _, runner = tiny
    logits = runner.forward([ForwardEntry(prompt(8, 6), 0, [0, 1], False)])
    assert logits.shape == (0, VOCAB_SIZE)


def test_info_and_page_budget(tiny) -> None:
    out_dir, _, runner = tiny
    config = json.loads((out_dir / "config.json").read_text())
    info = runner.info
    assert (info.vocab_size, info.context_len, info.page_size) == (VOCAB_SIZE, 512, PAGE_SIZE)
    assert info.eos_token_ids == [2] and info.rank == 0 and info.world_size == 1
    page_bytes = 2 * config["num_hidden_layers"] * PAGE_SIZE * config["num_key_value_heads"] * 16 * 4
    assert info.num_pages == KV_BYTES // page_bytes
    assert runner.pool.pages(0)[0].shape == (config["num_key_value_heads"], info.num_pages, PAGE_SIZE, 16)


def test_unsupported_rope_type_is_a_clear_error(tmp_path) -> None:
    out_dir = make_tiny_llama(tmp_path)
    config = json.loads((out_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "proportional", "rope_theta": 10000.0, "factor": 2.0}
    (out_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="unsupported RoPE type 'proportional'"):
        ModelRunner(RunnerConfig(model_dir=out_dir, kv_cache_bytes=KV_BYTES))


def test_linear_rope_scaling_matches_transformers(backend, tmp_path) -> None:
    out_dir = make_tiny_qwen2(tmp_path, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                         "rope_theta": 10000.0})
    reference = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    runner = ModelRunner(RunnerConfig(model_dir=out_dir, page_size=PAGE_SIZE, kv_cache_bytes=KV_BYTES,
                                      attention_kernel=backend))
    token_ids = prompt(9)
    logits = runner.forward([ForwardEntry(token_ids, 0, list(range(10)), True)])
    torch.testing.assert_close(logits[0], reference_logits(reference, token_ids)[-1], atol=TINY_ATOL, rtol=0)


# The CPU backends against transformers in half precision. The PyTorch backend runs PyTorch's
# flash kernel as transformers does: measured identical. The compiled kernel computes the same
# float32 scores in another order and rounds differently, so a logit may land a few bfloat16 steps
# away, but no further from the float32 truth than transformers' own half precision is (figures in
# docs/worker-backends.md); a wrong computation is off by more than 0.1.
HALF_ATOL = {"torch": 2e-2, "native": 4e-2}
HALF_ULP_AT_LOGITS = 1.6e-2  # one bfloat16 step at |logit| ~2.5


@pytest.mark.parametrize("kernel", [p for p in backend_params() if p.values[0] in HALF_ATOL])
@pytest.mark.parametrize(("make", "dtype"), [(make_tiny_llama, "bfloat16"), (make_tiny_qwen2, "float16")],
                         ids=["llama-bf16", "qwen2-fp16"])
def test_half_precision_matches_transformers_in_the_same_dtype(make, dtype, kernel, tmp_path) -> None:
    """bf16/fp16 (on CPUs with oneDNN support, through the packed-weight matmuls) against
    transformers in the same dtype, prefill and one decode step (see HALF_ATOL)."""
    out_dir = make(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(out_dir, dtype=getattr(torch, dtype)).eval()
    truth = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    runner = ModelRunner(RunnerConfig(model_dir=out_dir, dtype=dtype, page_size=PAGE_SIZE,
                                      kv_cache_bytes=KV_BYTES, attention_kernel=kernel))
    assert runner.backend.name == kernel
    token_ids = prompt(10)
    pages = list(range(10))
    expected = reference_logits(reference, token_ids).float()
    exact = reference_logits(truth, token_ids).float()
    prefilled = runner.forward([ForwardEntry(token_ids[:-1], 0, pages, True)])
    decoded = runner.forward([ForwardEntry(token_ids[-1:], len(token_ids) - 1, pages, True)])
    assert decoded.dtype == torch.float32
    for ours, theirs, true in [(prefilled[0], expected[-2], exact[-2]), (decoded[0], expected[-1], exact[-1])]:
        torch.testing.assert_close(ours, theirs, atol=HALF_ATOL[kernel], rtol=0)
        assert (ours - true).abs().max() <= (theirs - true).abs().max() + HALF_ULP_AT_LOGITS


def test_empty_step_returns_no_logits(tiny) -> None:
    _, _, runner = tiny
    assert runner.forward([]).shape == (0, VOCAB_SIZE)
