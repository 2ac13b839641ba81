"""Tiny random Llama and Qwen2 checkpoints for tests, saved with transformers' own classes.

Shapes are chosen to exercise the awkward cases: grouped-query attention (4 or 6 query heads over
2 or 3 KV heads), a KV-head count that TP=2 cannot split evenly (Llama: 3 KV heads), tied and untied
embeddings, Qwen2's q/k/v biases (made non-zero), and a scaled RoPE.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB_SIZE = 256
EOS_TOKEN_ID = 2


def _common(**overrides) -> dict:
    settings = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=0,
        # Larger than the default 0.02 so attention is far from uniform and errors would show.
        initializer_range=0.1,
    )
    settings.update(overrides)
    return settings


def _save(model: torch.nn.Module, out_dir: Path) -> Path:
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_tiny_llama(out_dir: Path, seed: int = 0, **overrides) -> Path:
    """A 2-layer Llama (6 q / 3 KV heads, tied embeddings, llama3-scaled RoPE) saved in `out_dir`."""
    torch.manual_seed(seed)
    settings = _common(
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    )
    settings.update(overrides)
    config = LlamaConfig(**settings)
    return _save(LlamaForCausalLM(config), out_dir)


def make_tiny_qwen2(out_dir: Path, seed: int = 0, **overrides) -> Path:
    """A 2-layer Qwen2 (4 q / 2 KV heads, untied LM head, non-zero q/k/v biases) saved in `out_dir`."""
    torch.manual_seed(seed)
    settings = _common(
        num_attention_heads=4, num_key_value_heads=2, hidden_size=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    settings.update(overrides)
    config = Qwen2Config(**settings)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        # transformers initialises biases to zero; random ones make the test see them.
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return _save(model, out_dir)


def greedy_tokens(runner, prompt_ids: list[int], num_tokens: int, page_table: list[int]) -> list[int]:
    """Greedy continuation with a `ModelRunner` (rank 0 / TP=1): one prefill, then decode steps.

    Never stops at EOS, so that it can be compared with a `generate` that does not stop either.
    """
    from worker_service.forward_batch import ForwardEntry

    logits = runner.forward([ForwardEntry(list(prompt_ids), 0, page_table, True)])
    tokens = [int(logits[0].argmax())]
    while len(tokens) < num_tokens:
        position = len(prompt_ids) + len(tokens) - 1
        logits = runner.forward([ForwardEntry([tokens[-1]], position, page_table, True)])
        tokens.append(int(logits[0].argmax()))
    return tokens


def reference_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """transformers' `generate(do_sample=False)` continuation of exactly `num_tokens` tokens."""
    model.generation_config.eos_token_id = None
    output = model.generate(
        torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=num_tokens, do_sample=False, pad_token_id=0,
    )
    return output[0, len(prompt_ids):].tolist()


def assert_matches_reference(runner, reference, prompt_ids: list[int], num_tokens: int) -> None:
    """`runner`'s (TP=1) last-position logits of `prompt_ids` equal transformers' `reference`
    within 1e-4 of their largest magnitude, and its `num_tokens` greedy tokens are the same."""
    from worker_service.forward_batch import ForwardEntry

    page_table = list(range((len(prompt_ids) + num_tokens) // runner.info.page_size + 1))
    logits = runner.forward([ForwardEntry(list(prompt_ids), 0, page_table, True)])[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt_ids])).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4 * float(expected.abs().max()), rtol=0)
    assert greedy_tokens(runner, prompt_ids, num_tokens, page_table) == reference_greedy(reference, prompt_ids,
                                                                                         num_tokens)


def greedy_logits_and_reference(runner, model, prompt_ids: list[int], num_steps: int,
                                page_table: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """`runner`'s logits of the prompt and of `num_steps` greedy decode steps, transformers'
    `model`'s over the same tokens (one forward), and the greedy tokens."""
    from worker_service.forward_batch import ForwardEntry

    logits = [runner.forward([ForwardEntry(list(prompt_ids), 0, page_table, True)])[0]]
    tokens = [int(logits[0].argmax())]
    for step in range(num_steps):
        logits.append(runner.forward([ForwardEntry(tokens[-1:], len(prompt_ids) + step, page_table, True)])[0])
        tokens.append(int(logits[-1].argmax()))
    with torch.no_grad():
        expected = model(torch.tensor([list(prompt_ids) + tokens[:-1]])).logits[0, len(prompt_ids) - 1:]
    return torch.stack(logits), expected, tokens
