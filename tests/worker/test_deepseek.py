"""DeepSeek beyond the family suite (`test_model_families.py` runs V2 and V3 with a narrow latent on
every backend and at TP=2): the released latent width (512 + 64 = 576 dims, the compiled kernel's
own case), what the pool holds per token (the latent row once), bfloat16 and int8 weights against transformers in
float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from worker.families import VOCAB_SIZE, make_family
from worker.test_model_families import ATOL, require_backend
from worker.tiny_models import greedy_logits_and_reference
from worker_service.forward_batch import ForwardEntry
from worker_service.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.timeout(300)
PROMPT_LEN = 37
DECODE_STEPS = 6
# bfloat16 activations or int8 weights against float32 transformers, logits of magnitude ~2.5:
# measured 0.030 (torch) and 0.034 (native) in bfloat16, 0.057 with int8 weights.
BFLOAT16_ATOL, INT8_ATOL = 0.1, 0.15


@pytest.fixture(scope="module")
def released_width(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """DeepSeek-V3's layers (query latent, sigmoid routing, shared experts) at the released latent
    width: `kv_lora_rank` 512 and `qk_rope_head_dim` 64."""
    model_dir = make_family("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"), kv_lora_rank=512,
                            qk_rope_head_dim=64, head_dim=64)
    return model_dir, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def prompt() -> list[int]:
    return torch.randint(3, VOCAB_SIZE, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()


def runner_for(model_dir: Path, kernel: str, **settings) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=model_dir, page_size=4, kv_cache_bytes=1 << 22,
                                    attention_kernel=kernel, **settings))


@pytest.mark.parametrize("kernel", ("torch", "native"))
def test_the_released_latent_width_matches_transformers(released_width, kernel) -> None:
    """One KV head of 576 dims per token in the pool, held once, at transformers' logits over a
    prompt and greedy steps (the compiled backend by its 576-dim kernel, not PyTorch's ops)."""
    require_backend(kernel)
    model_dir, reference = released_width
    runner = runner_for(model_dir, kernel)
    assert runner.backend.name == kernel
    assert (runner.pool.num_kv_heads, runner.pool.head_dim) == (1, 576)
    keys, values = runner.pool.slots(0)  # held once: the values are the keys
    assert runner.pool.buffer.shape[0] == 1 and values.data_ptr() == keys.data_ptr()
    logits, expected, _ = greedy_logits_and_reference(runner, reference, prompt(), DECODE_STEPS, list(range(20))[::-1])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("kernel", "settings", "atol"), [
    ("torch", dict(dtype="bfloat16"), BFLOAT16_ATOL),
    ("native", dict(dtype="bfloat16"), BFLOAT16_ATOL),
    ("torch", dict(quantization="int8"), INT8_ATOL),
    ("native", dict(dtype="bfloat16", quantization="int8"), INT8_ATOL),
], ids=["torch-bf16", "native-bf16", "torch-int8", "native-bf16-int8"])
def test_bfloat16_and_int8_weights_stay_near_float32(released_width, kernel, settings, atol) -> None:
    """The absorbed query and output products in bfloat16, and int8 projections (the q rows
    carrying the folded softmax scale quantized with them), near float32 transformers."""
    require_backend(kernel)
    model_dir, reference = released_width
    runner = runner_for(model_dir, kernel, **settings)
    token_ids = prompt()
    served = runner.forward([ForwardEntry(token_ids, 0, list(range(12)), True)])[0].float()
    with torch.no_grad():
        expected = reference(torch.tensor([token_ids])).logits[0, -1]
    torch.testing.assert_close(served, expected, atol=atol, rtol=0)
