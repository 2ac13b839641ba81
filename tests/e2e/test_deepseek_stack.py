"""DeepSeek through the whole stack: `radixserve up` with a tiny random DeepSeek-V3 (multi-head
latent attention at the released latent width of 512 + 64, sigmoid-routed experts with shared ones)
speaking SmolLM2's vocabulary. Greedy tokens equal to transformers' one chat at a time, all three at
once and again from the radix cache, whose pages hold latent rows rather than keys and values."""

from __future__ import annotations

import pytest

from constrained_model import SMOLLM2_VOCAB_SIZE, with_smollm2_tokenizer
from e2e.parity import check_alone_together_and_cached
from e2e.reference import MAX_NEW_TOKENS, greedy_references
from e2e.stack import launch
from procs import ServiceProcesses
from worker.families import make_family


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory, smollm2_dir):
    out_dir = make_family("deepseek_v3", tmp_path_factory.mktemp("deepseek-stack"), vocab_size=SMOLLM2_VOCAB_SIZE,
                          kv_lora_rank=512, qk_rope_head_dim=64, head_dim=64)
    return with_smollm2_tokenizer(out_dir, smollm2_dir)


@pytest.fixture(scope="module")
def references(deepseek_dir):
    return greedy_references(deepseek_dir)


@pytest.fixture(scope="module")
def stack(deepseek_dir):
    with ServiceProcesses() as procs:
        yield launch(procs, deepseek_dir, tp=1, default_max_tokens=MAX_NEW_TOKENS)


@pytest.mark.timeout(300)
def test_deepseek_chats_match_transformers_alone_together_and_from_the_cache(stack, references) -> None:
    check_alone_together_and_cached(stack.gateway, references)
