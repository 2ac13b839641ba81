"""Attention with `AttentionOptions` (a sliding window, logit soft-capping, a softmax scale, sinks), in
PyTorch's ops, reading K/V only through the step's page tables: what every backend runs for a
layer that asks for options (no compiled or Triton kernel has them).

Each query sees the keys from max(0, its position - window + 1) to its own position; scores are
q . k * scale, soft-capped, masked (causal, within the window), softmaxed in float32 and cast back
before the product with the values, as the reference eager code computes them. A head's sink is
one more score in its softmax, whose weight is dropped. The new K/V must already be in the pool.
A window shorter than the context only masks keys: the pages stay allocated and cached
(full-attention layers still read them).

The step is attended in groups (`groups_for`), each one product over padded keys:
- decode rows, sorted by how many keys they see, several to a group (up to `KEYS_PER_GROUP` keys
  gathered in all), so a batch of decode rows costs a few products, not one per row;
- each prefill chunk, its keys gathered once and its queries taken in blocks of at most
  `PAIRS_PER_BLOCK` query-key pairs, each block over the keys its queries see.
The groups depend on the step and the window only, so they are built once per step and window
(`StepBatch.gathers`) and shared by every layer with that window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_service.backends.base import AttentionOptions, StepBatch

# Keys gathered per group of decode rows: enough that a group is a real product, few enough that
# its K/V copies stay a few MiB a head.
KEYS_PER_GROUP = 8192
# Query-key pairs scored at once in a prefill chunk (float32 scores of 4 MiB a query head).
PAIRS_PER_BLOCK = 1 << 20


@dataclass(slots=True)
class AttentionGroup:
    """`n` sequences' `Lq` queries each (`token_ids` `[n, Lq]` into the flat layout, at
    `query_positions`) over `L` keys each (`slots` `[n, L]` in the pool, at `key_positions`), the
    keys in position order; a sequence's padding keys have positions past its queries (the causal
    mask hides them) and read its last key's slot. `first_query` and `first_key`: the
    positions of the first sequence's first query and first key (on the host)."""

    token_ids: torch.Tensor
    query_positions: torch.Tensor
    slots: torch.Tensor
    key_positions: torch.Tensor
    first_query: int
    first_key: int


def _group(spans: list[tuple[list[int], int, torch.Tensor, int, int]], page_size: int,
           device: torch.device) -> AttentionGroup:
    """One group from (query tokens, first query position, pages, first key, end) per sequence,
    each with as many queries as the others."""
    width = max(end - first for _, _, _, first, end in spans)
    slots, key_positions = [], []
    for _, _, pages, first, end in spans:
        keys = torch.arange(first, first + width)
        real = keys.clamp(max=end - 1)
        slots.append(pages[real // page_size] * page_size + real % page_size)
        key_positions.append(keys)
    queries = [torch.arange(start, start + len(tokens)) for tokens, start, *_ in spans]
    return AttentionGroup(torch.tensor([tokens for tokens, *_ in spans], device=device),
                          torch.stack(queries).to(device), torch.stack(slots).to(device),
                          torch.stack(key_positions).to(device), spans[0][1], spans[0][3])


def groups_for(batch: StepBatch, window: int | None, device: torch.device) -> list[AttentionGroup]:
    """The step's attention groups for layers with `window` (module doc), built once per step."""
    cached = batch.gathers.get(window)
    if cached is not None:
        return cached
    page_size, groups = batch.page_size, []

    def first_key(position: int) -> int:
        return 0 if window is None else max(0, position - window + 1)

    lengths = batch.decode_context_lens
    spans = []
    for row in sorted(range(len(lengths)), key=lambda row: lengths[row] - first_key(lengths[row] - 1)):
        length = lengths[row]
        span = ([row], length - 1, torch.tensor(batch.decode_tables[row][:(length + page_size - 1) // page_size]),
                first_key(length - 1), length)
        if spans and (len(spans) + 1) * (length - span[3]) > KEYS_PER_GROUP:
            groups.append(_group(spans, page_size, device))
            spans = []
        spans.append(span)
    if spans:
        groups.append(_group(spans, page_size, device))
    for chunk in batch.prefills:
        tokens = list(range(chunk.token_start, chunk.token_start + chunk.num_tokens))
        end = chunk.start_position + chunk.num_tokens
        groups.append(_group([(tokens, chunk.start_position, chunk.pages, first_key(chunk.start_position), end)],
                             page_size, device))
    batch.gathers[window] = groups
    return groups


def windowed_attention(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, batch: StepBatch | None,
                       options: AttentionOptions) -> torch.Tensor:
    """q `[T, Hq, D]` over one layer's head-major pool `[Hk, num_slots, D]` -> `[T, Hq, D]`."""
    if batch is None:
        raise RuntimeError("attention with options needs the step's layout, which a replayed step lacks")
    num_kv_heads, head_dim = k_slots.shape[0], q.shape[-1]
    group_size = q.shape[1] // num_kv_heads
    scale = head_dim ** -0.5 if options.scale is None else options.scale
    sinks = None if options.sinks is None else options.sinks.float().view(num_kv_heads, 1, group_size, 1, 1)
    out = torch.empty_like(q)
    for group in groups_for(batch, options.window, q.device):
        n, num_queries = group.token_ids.shape
        flat_tokens = group.token_ids.flatten()
        # [n * Lq, Hq, D] -> [Hk, n, G, Lq, D]; keys and values [Hk, n, 1, L, D].
        queries = q.index_select(0, flat_tokens).view(n, num_queries, num_kv_heads, group_size, head_dim)
        queries = queries.permute(2, 0, 3, 1, 4)
        flat_slots = group.slots.flatten()
        keys = k_slots.index_select(1, flat_slots).view(num_kv_heads, n, 1, -1, head_dim)
        values = v_slots.index_select(1, flat_slots).view(num_kv_heads, n, 1, -1, head_dim)
        attended = torch.empty_like(queries)
        block = max(1, PAIRS_PER_BLOCK // keys.shape[3])
        for lo in range(0, num_queries, block):  # decode groups: one block
            hi = min(lo + block, num_queries)
            first, last = 0, keys.shape[3]
            if n == 1:  # a prefill chunk: the keys its block's queries see, first query's first to last query
                start = group.first_query + lo
                first = 0 if options.window is None else max(0, start - options.window + 1 - group.first_key)
                last = group.first_query + hi - group.first_key
            attended[:, :, :, lo:hi] = _attend(queries[:, :, :, lo:hi], keys[:, :, :, first:last],
                                               values[:, :, :, first:last], group.query_positions[:, lo:hi],
                                               group.key_positions[:, first:last], scale, options, sinks)
        out[flat_tokens] = attended.permute(1, 3, 0, 2, 4).reshape(n * num_queries, -1, head_dim)
    return out


def _attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_positions: torch.Tensor,
            key_positions: torch.Tensor, scale: float, options: AttentionOptions,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """`[Hk, n, G, Lq, D]` queries over `[Hk, n, 1, L, D]` keys and values (module doc)."""
    n, num_queries, width = queries.shape[1], queries.shape[3], keys.shape[3]
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale  # [Hk, n, G, Lq, L]
    if options.softcap is not None:
        scores = torch.tanh(scores / options.softcap) * options.softcap
    query_at, key_at = query_positions.unsqueeze(2), key_positions.unsqueeze(1)  # [n, Lq, 1], [n, 1, L]
    allowed = key_at <= query_at
    if options.window is not None:
        allowed &= query_at - key_at < options.window
    scores = scores.masked_fill(~allowed.view(1, n, 1, num_queries, width), float("-inf")).float()
    if sinks is None:
        probabilities = torch.softmax(scores, dim=-1).to(queries.dtype)
    else:
        with_sinks = torch.cat([scores, sinks.expand(-1, n, -1, num_queries, 1)], dim=-1)
        probabilities = torch.softmax(with_sinks, dim=-1)[..., :-1].to(queries.dtype)
    return torch.matmul(probabilities, values)
