"""Attention with options (`attention/windowed.py`) against transformers' eager attention with sinks
(GPT-OSS's `eager_attention_forward`, whose sinks of -inf are plain softmax attention), on a step
that mixes decode rows of several lengths and prefill chunks starting at 0 and mid-sequence, pages
out of order: with and without a window, with and without sinks, and with the grouping budgets
cut so far that decode rows split over several groups and prefill chunks over several query blocks
(the results must not depend on how the step was grouped)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from worker_service.backends.base import AttentionOptions, PrefillChunk, StepBatch  # noqa: I001 (first: the
from worker_service.attention import windowed  # backends package imports windowed.py)

PAGE_SIZE, KV_HEADS, GROUP, HEAD_DIM = 4, 2, 3, 8
DECODE_LENGTHS = [5, 17, 9, 33, 2]
PREFILLS = [(0, 11), (20, 15)]  # (first position, tokens)


def step() -> tuple[StepBatch, list[tuple[int, int, int, list[int]]]]:
    """The step, and (first token in the flat layout, tokens, first position, page table) per sequence."""
    generator = torch.Generator().manual_seed(3)
    free = torch.randperm(64, generator=generator).tolist()
    sequences, token = [], len(DECODE_LENGTHS)
    for row, length in enumerate(DECODE_LENGTHS):
        sequences.append((row, 1, length - 1, [free.pop() for _ in range(-(-length // PAGE_SIZE))]))
    prefills = []
    for start, count in PREFILLS:
        table = [free.pop() for _ in range(-(-(start + count) // PAGE_SIZE))]
        prefills.append(PrefillChunk(token, start, count, table, torch.tensor(table)))
        sequences.append((token, count, start, table))
        token += count
    batch = StepBatch(PAGE_SIZE, torch.zeros(token, dtype=torch.long), torch.zeros(token, dtype=torch.long),
                      [table for _, _, _, table in sequences[:len(DECODE_LENGTHS)]], DECODE_LENGTHS, prefills)
    return batch, sequences


def reference(q, k_slots, v_slots, sequences, window, sinks) -> torch.Tensor:
    module = SimpleNamespace(num_key_value_groups=GROUP, training=False,
                             sinks=torch.full((KV_HEADS * GROUP,), float("-inf")) if sinks is None else sinks)
    out = torch.empty_like(q)
    for token, count, start, table in sequences:
        end = start + count
        positions = torch.arange(end)
        slots = torch.tensor(table)[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        keys, values = k_slots[:, slots].unsqueeze(0), v_slots[:, slots].unsqueeze(0)
        queries = q[token:token + count].transpose(0, 1).unsqueeze(0)
        query_at = torch.arange(start, end).unsqueeze(1)
        visible = positions.unsqueeze(0) <= query_at
        if window is not None:
            visible &= query_at - positions.unsqueeze(0) < window
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf")).view(1, 1, count, end)
        attended, _ = eager_attention_forward(module, queries, keys, values, mask, HEAD_DIM ** -0.5)
        out[token:token + count] = attended[0]
    return out


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_grouped_attention_matches_transformers_however_the_step_is_grouped(window, with_sinks, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    batch, sequences = step()
    num_tokens = batch.positions.shape[0]
    q = torch.randn(num_tokens, KV_HEADS * GROUP, HEAD_DIM, generator=generator)
    k_slots = torch.randn(KV_HEADS, 64 * PAGE_SIZE, HEAD_DIM, generator=generator)
    v_slots = torch.randn(KV_HEADS, 64 * PAGE_SIZE, HEAD_DIM, generator=generator)
    sinks = torch.randn(KV_HEADS * GROUP, generator=generator) if with_sinks else None
    options = AttentionOptions(window=window, sinks=sinks)
    expected = reference(q, k_slots, v_slots, sequences, window, sinks)

    calls = []
    attend = windowed._attend
    monkeypatch.setattr(windowed, "_attend", lambda *args: calls.append(1) or attend(*args))
    whole = windowed.windowed_attention(q, k_slots, v_slots, batch, options)
    assert len(calls) == 1 + len(PREFILLS)  # every decode row in one product, each chunk's queries in one
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=0)

    monkeypatch.setattr(windowed, "KEYS_PER_GROUP", 12)
    monkeypatch.setattr(windowed, "PAIRS_PER_BLOCK", 30)
    batch, _ = step()
    calls.clear()
    cut = windowed.windowed_attention(q, k_slots, v_slots, batch, options)
    assert len(batch.gathers[window]) > 2 + len(PREFILLS) and len(calls) > len(batch.gathers[window]) + 4
    torch.testing.assert_close(cut, expected, atol=1e-5, rtol=0)
