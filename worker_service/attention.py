"""Paged attention: K/V are written to and read from the pool only through page tables.

A forward pass lays its tokens out decode-first: the single-token entries (decode steps) come
first, one token each, then each prefill chunk as a contiguous span. Per layer:

1. the new tokens' K/V are written into their slots with one `index_copy_`;
2. all decode tokens attend in ONE padded `scaled_dot_product_attention` call: each one's context
   is gathered by slot index into `[B, L]` and padding is masked out; the query heads of a KV group
   ride in the query-length axis so K/V are never repeated per query head;
3. each prefill chunk attends on its own: a chunk starting at position 0 uses its fresh K/V with a
   plain causal mask (the fast path); a chunk starting later gathers its whole context from the
   pool and uses a causal mask shifted by its start position.

Which physical pages hold a sequence cannot change the result: only slot indices differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk: tokens `token_start:token_stop` of the flat layout.

    `context_slots` ([L], positions 0..L-1) and `mask` ([Q, L], additive: 0 where a query may
    attend, -inf elsewhere) are None when the chunk starts at position 0 and needs nothing from
    the pool.
    """

    token_start: int
    token_stop: int
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionBatch:
    """Where one forward pass writes and reads K/V; built once, used by every layer."""

    write_slots: torch.Tensor  # [T]: slot of each token of the flat layout
    num_decode: int  # the first num_decode tokens are single-token entries
    decode_context_slots: torch.Tensor | None  # [B, L]: slots of positions 0..L-1 (padded)
    decode_mask: torch.Tensor | None  # [B, 1, 1, L]: 0 where the token may attend, -inf elsewhere
    prefills: list[PrefillSpan]


def context_slots(page_table: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """Slots of positions 0..length-1 for page tables `[..., num_pages]` -> `[..., length]`."""
    offsets = torch.arange(page_size, device=page_table.device)
    slots = page_table.unsqueeze(-1) * page_size + offsets
    return slots.flatten(-2)[..., :length]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `allowed`, -inf elsewhere: made once per step, so SDPA need not convert a bool
    mask in every layer."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf"))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    batch: AttentionBatch,
) -> torch.Tensor:
    """Attention for the flat layout: q [T, Hq, D], k/v [T, Hk, D] -> [T, Hq, D].

    `k_slots` / `v_slots` are this layer's pool, `[num_slots, Hk, D]`; the new K/V are stored
    there before anything is read.
    """
    k_slots.index_copy_(0, batch.write_slots, k)
    v_slots.index_copy_(0, batch.write_slots, v)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    group_size = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)

    if batch.num_decode:
        num_decode = batch.num_decode
        slots = batch.decode_context_slots
        context_len = slots.shape[1]
        # [B, Hk, L, D] gathered by slot; [B, Hk, g, D] queries: a KV group's heads share one K/V.
        # index_select, not k_slots[slots]: advanced indexing is ~10x slower on CPU for this.
        flat_slots = slots.flatten()
        keys = k_slots.index_select(0, flat_slots).view(num_decode, context_len, num_kv_heads, head_dim)
        values = v_slots.index_select(0, flat_slots).view(num_decode, context_len, num_kv_heads, head_dim)
        queries = q[:num_decode].view(num_decode, num_kv_heads, group_size, head_dim)
        attended = F.scaled_dot_product_attention(
            queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=batch.decode_mask
        )
        out[:num_decode] = attended.reshape(num_decode, -1, head_dim)

    for span in batch.prefills:
        queries = q[span.token_start:span.token_stop].transpose(0, 1).unsqueeze(0)
        if span.context_slots is None:
            keys = k[span.token_start:span.token_stop]
            values = v[span.token_start:span.token_stop]
        else:
            keys = k_slots.index_select(0, span.context_slots)
            values = v_slots.index_select(0, span.context_slots)
        keys = keys.transpose(0, 1).unsqueeze(0)
        values = values.transpose(0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(
            queries, keys, values,
            attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=group_size > 1,
        )
        out[span.token_start:span.token_stop] = attended.squeeze(0).transpose(0, 1)
    return out
