"""Our Llama on the default SmolLM2-135M-Instruct checkpoint against transformers (fp32, CPU), on
every backend this machine runs (`backend_params`)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.backend_params import backend_params
from worker_service.forward_batch import ForwardEntry
from worker_service.model_runner import ModelRunner, RunnerConfig

# Logits reach |25|; fp32 rounding over 30 layers, with our kernels (merged q/k/v and gate/up
# matmuls, fused RMSNorm, paged SDPA) against transformers' own, differs by ~3e-5 in measurements.
# 1e-3 keeps a 30x margin for other CPUs while a real mistake moves logits by > 1e-1.
SMOLLM2_ATOL = 1e-3
NUM_NEW_TOKENS = 32
KV_BYTES = 64 << 20


@pytest.fixture(scope="module")
def prompt_ids(smollm2_dir) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "Name three planets of the solar system and one fact about each."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text)["input_ids"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", backend_params(head_dim=64))
def test_smollm2_logits_and_greedy_tokens_match_transformers(smollm2_dir, prompt_ids, backend) -> None:
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None  # exactly NUM_NEW_TOKENS, as ours
    with torch.no_grad():
        generated = reference.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=NUM_NEW_TOKENS, do_sample=False, pad_token_id=2,
            output_logits=True, return_dict_in_generate=True,
        )
    expected_tokens = generated.sequences[0, len(prompt_ids):].tolist()
    expected_logits = torch.cat(generated.logits).float()  # [NUM_NEW_TOKENS, vocab]
    del reference

    runner = ModelRunner(RunnerConfig(model_dir=smollm2_dir, kv_cache_bytes=KV_BYTES, attention_kernel=backend))
    assert runner.backend.name == backend
    assert runner.info.vocab_size == 49152 and runner.info.eos_token_ids == [2]
    # Pages handed out in a scrambled order, as a router with a used-up free list would.
    num_pages = (len(prompt_ids) + NUM_NEW_TOKENS) // runner.info.page_size + 1
    page_table = torch.randperm(runner.info.num_pages, generator=torch.Generator().manual_seed(0))
    page_table = page_table[:num_pages].tolist()

    logits = runner.forward([ForwardEntry(prompt_ids, 0, page_table, True)])
    tokens = [int(logits[0].argmax())]
    all_logits = [logits[0]]
    while len(tokens) < NUM_NEW_TOKENS:
        position = len(prompt_ids) + len(tokens) - 1
        logits = runner.forward([ForwardEntry([tokens[-1]], position, page_table, True)])
        tokens.append(int(logits[0].argmax()))
        all_logits.append(logits[0])

    assert tokens == expected_tokens
    torch.testing.assert_close(torch.stack(all_logits), expected_logits, atol=SMOLLM2_ATOL, rtol=0)
