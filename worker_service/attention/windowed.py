"""Attention with `AttentionOptions` (a sliding window, logit soft-capping, a softmax scale, sinks), in
PyTorch's ops, reading K/V only through the step's page tables: what every backend runs for a
layer that asks for options (no compiled or Triton kernel has them).

Per sequence of the step (each decode row, each prefill chunk): the keys it may need are those
from max(0, first query position - window + 1) to its last position, gathered from the pool by
its page table; scores are q . k * scale, soft-capped, masked (causal, and within the window),
softmaxed in float32 and cast back before the product with the values, as the reference eager
code computes them. A head's sink is one more score in its softmax, whose weight is dropped. The new K/V must already be in the pool. A window shorter than the context
only masks keys: the pages stay allocated and cached (full-attention layers still read them).
"""

from __future__ import annotations

import torch

from worker_service.backends.base import AttentionOptions, StepBatch


def sequence_spans(batch: StepBatch) -> list[tuple[int, int, int, list[int]]]:
    """(first token in the flat layout, number of tokens, position of the first, page table) of
    each decode row and each prefill chunk of the step."""
    spans = [(row, 1, length - 1, table)
             for row, (table, length) in enumerate(zip(batch.decode_tables, batch.decode_context_lens))]
    spans += [(c.token_start, c.num_tokens, c.start_position, c.page_ids) for c in batch.prefills]
    return spans


def windowed_attention(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, batch: StepBatch | None,
                       options: AttentionOptions) -> torch.Tensor:
    """q `[T, Hq, D]` over one layer's head-major pool `[Hk, num_slots, D]` -> `[T, Hq, D]`."""
    if batch is None:
        raise RuntimeError("attention with options needs the step's layout, which a replayed step lacks")
    num_kv_heads, head_dim = k_slots.shape[0], q.shape[-1]
    group = q.shape[1] // num_kv_heads
    scale = head_dim ** -0.5 if options.scale is None else options.scale
    offsets = torch.arange(batch.page_size, device=q.device)
    out = torch.empty_like(q)
    for token_start, num_tokens, start, page_ids in sequence_spans(batch):
        end = start + num_tokens
        first = 0 if options.window is None else max(0, start - options.window + 1)
        pages = torch.tensor(page_ids[:(end + batch.page_size - 1) // batch.page_size], device=q.device)
        slots = (pages.unsqueeze(1) * batch.page_size + offsets).flatten()[first:end]
        keys, values = k_slots.index_select(1, slots), v_slots.index_select(1, slots)  # [Hk, L, D]
        queries = q[token_start:token_start + num_tokens].view(num_tokens, num_kv_heads, group, head_dim)
        scores = torch.einsum("nhgd,hld->hgnl", queries, keys) * scale
        if options.softcap is not None:
            scores = torch.tanh(scores / options.softcap) * options.softcap
        query_positions = torch.arange(start, end, device=q.device).unsqueeze(1)
        key_positions = torch.arange(first, end, device=q.device).unsqueeze(0)
        allowed = key_positions <= query_positions
        if options.window is not None:
            allowed &= query_positions - key_positions < options.window
        scores = scores.masked_fill(~allowed, float("-inf")).float()
        if options.sinks is None:
            probabilities = torch.softmax(scores, dim=-1).to(q.dtype)
        else:
            sinks = options.sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, num_tokens, 1)
            probabilities = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1].to(q.dtype)
        attended = torch.einsum("hgnl,hld->nhgd", probabilities, values)
        out[token_start:token_start + num_tokens] = attended.reshape(num_tokens, -1, head_dim)
    return out
