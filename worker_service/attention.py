"""Paged attention: K/V are written to and read from the pool only through page tables.

A forward pass lays its tokens out decode-first: the single-token entries (decode steps) come
first, one token each, then each prefill chunk as a contiguous span. Per layer:

1. the new tokens' K/V are written into their slots with one `index_copy_`;
2. all decode tokens attend in ONE padded `scaled_dot_product_attention` call: each one's pages
   are gathered into `[B, pages * page_size]` positions and what lies past its context is masked;
   the query heads of a KV group ride in the query-length axis, so K/V are never repeated;
3. each prefill chunk attends on its own: a chunk starting at position 0 uses its fresh K/V with
   the plain causal kernel (the fast path); a chunk starting later gathers its context's pages
   from the pool and uses a causal mask shifted by its start position.

Pages, not slots, are gathered: `index_select` over rows of one page (page_size * heads * dim
values) copies about twice as fast as over rows of one token. Which physical pages hold a
sequence cannot change the result: only gather indices differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk: tokens `token_start:token_stop` of the flat layout.

    `context_pages` ([P]: the pages of positions 0..end-1) and `mask` ([Q, P * page_size],
    additive) are None when the chunk starts at position 0 and needs nothing from the pool.
    """

    token_start: int
    token_stop: int
    context_pages: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionBatch:
    """Where one forward pass writes and reads K/V; built once per step, used by every layer.

    Masks are additive (0 where a query may attend, -inf elsewhere) in the model dtype, made once
    so that SDPA need not convert a boolean mask in every layer.
    """

    page_size: int
    write_slots: torch.Tensor  # [T]: slot of each token of the flat layout
    num_decode: int  # the first num_decode tokens are single-token entries
    decode_pages: torch.Tensor | None  # [B, P]: each decode entry's pages, padded with page 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, P * page_size]
    prefills: list[PrefillSpan]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `allowed`, -inf elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf"))


def _gather_pages(slots: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Rows of whole pages: `[num_slots, H, D]` pool, pages `[...]` -> `[numel(pages) * page_size, H, D]`."""
    by_page = slots.view(slots.shape[0] // page_size, -1)
    return by_page.index_select(0, pages.flatten()).view(-1, *slots.shape[1:])


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
    page_size = batch.page_size
    parts: list[torch.Tensor] = []  # outputs in flat-layout order: decode block, then each span

    if batch.num_decode:
        num_decode = batch.num_decode
        context_len = batch.decode_pages.shape[1] * page_size
        shape = (num_decode, context_len, num_kv_heads, head_dim)
        keys = _gather_pages(k_slots, batch.decode_pages, page_size).view(shape).transpose(1, 2)
        values = _gather_pages(v_slots, batch.decode_pages, page_size).view(shape).transpose(1, 2)
        queries = q[:num_decode].view(num_decode, num_kv_heads, group_size, head_dim)
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=batch.decode_mask)
        parts.append(attended.view(num_decode, -1, head_dim))

    for span in batch.prefills:
        queries = q[span.token_start:span.token_stop].transpose(0, 1).unsqueeze(0)
        if span.context_pages is None:
            keys = k[span.token_start:span.token_stop]
            values = v[span.token_start:span.token_stop]
        else:
            keys = _gather_pages(k_slots, span.context_pages, page_size)
            values = _gather_pages(v_slots, span.context_pages, page_size)
        keys = keys.transpose(0, 1).unsqueeze(0)
        values = values.transpose(0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(
            queries, keys, values,
            attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=group_size > 1,
        )
        parts.append(attended.squeeze(0).transpose(0, 1))
    # One part (all decode, or one prompt) is the common step: no copy then.
    return parts[0] if len(parts) == 1 else torch.cat(parts)
