"""Batch- and cache-invariant paged attention: a query's result depends only on the query, its
position and the K/V of its own sequence, never on what else the step holds.

What makes PyTorch's CPU attention vary (and why this module exists): a float32 matrix product
sums in an order that depends on how many rows it multiplies (MKL and oneDNN pick their blocking
from the shape), the fused flash kernel splits queries and keys into blocks sized from the
sequence lengths, and the cascade merges a shared prefix computed for a group. So the same token
attended alone, among other requests' rows, as part of a prefill chunk, or over a prefix read from
the cache instead of computed in the same chunk, rounds differently; where two tokens nearly tie,
a greedy answer changes.

Here every query is reduced in one fixed order:
- its keys are cut into chunks of `chunk_pages(page_size)` whole pages (positions j * C ..
  (j + 1) * C - 1, the same chunks whatever else is attended);
- per chunk, scores q . k and the chunk's weighted values come from matrix products of one fixed
  shape: `[rows, D] x [D, C]` and `[rows, C] x [C, D]`, the query rows padded to a multiple of
  `QUERY_ROW_TILE` (products of such shapes give each row the same bits whatever the other rows
  are and however many tiles are multiplied together; `tests/worker/test_invariance_kernels.py`
  holds this to account); everything else is row-wise or element-wise;
- the chunks are merged by log-sum-exp in page order: weights exp(m_j - max_j m_j) and a running
  sum over the chunks in order (a cumulative sum, whose trailing terms for chunks past the
  query's context are exact zeros), so a query padded to a longer neighbour's chunk count, or
  attended in a prefill chunk, gets the same bits as when attended alone.

All of it in float32 (bfloat16 / float16 K/V are widened per chunk), the result cast to q's dtype.
The new K/V must be in the pool before `attend` reads it (a prefill chunk reads its own keys from
the pool too, so prefill and decode see identical K/V bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_service.attention.kernels import GatherSpace, gather_pages
from worker_service.row_tiles import ROW_TILE, padded_rows

# Keys per chunk, rounded to whole pages: long enough that a chunk's products are real matrix
# products, short enough that a decode row wastes at most one partial chunk.
KEYS_PER_CHUNK = 64
# Query rows of one product are padded to a multiple of this (see the module doc).
QUERY_ROW_TILE = ROW_TILE


# (window, softcap, scale, sinks) as `backends.base.AttentionOptions` means them (kept apart from
# it: the backends import this module).
Limits = tuple[int | None, float | None, float | None, torch.Tensor | None]
NO_LIMITS: Limits = (None, None, None, None)


def chunk_pages(page_size: int) -> int:
    """Pages per chunk: `KEYS_PER_CHUNK` keys rounded up to whole pages."""
    return max(1, -(-KEYS_PER_CHUNK // page_size))


@dataclass(slots=True)
class InvariantGroup:
    """Sequences attended in one call: `rows` sequences of `num_tokens` query tokens each.

    `token_ids` `[rows, num_tokens]` index the step's flat layout; `positions` `[rows, num_tokens]`
    are the queries' positions; `pages` `[rows, num_chunks * chunk_pages]` the pages covering
    positions 0 .. num_chunks * C - 1 (page 0 where a row has fewer: masked out).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    pages: torch.Tensor


def group_of(rows: list[tuple[list[int], list[int], list[int]]], page_size: int,
             device: torch.device) -> InvariantGroup:
    """An `InvariantGroup` from (token ids, positions, page table) per sequence, all with the
    same number of tokens."""
    per_chunk = chunk_pages(page_size)
    num_chunks = max(-(-(max(positions) + 1) // (per_chunk * page_size)) for _, positions, _ in rows)
    width = num_chunks * per_chunk
    pages = [(table[:width] + [0] * width)[:width] for _, _, table in rows]
    return InvariantGroup(torch.tensor([ids for ids, _, _ in rows], device=device),
                          torch.tensor([positions for _, positions, _ in rows], device=device),
                          torch.tensor(pages, device=device))


def attend_group(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, group: InvariantGroup,
                 page_size: int, limits: Limits = NO_LIMITS, space: GatherSpace | None = None) -> torch.Tensor:
    """The group's queries of the flat-layout `q` `[T, Hq, D]` over one layer's head-major pool
    `[Hk, num_slots, D]` -> `[rows, num_tokens, Hq, D]` in q's dtype, with `limits` (window,
    softcap, scale, sinks: as `AttentionOptions` means them; None each: plain causal attention).
    A head's sink joins each of its rows' denominators after the chunks' merge (row-wise)."""
    window, softcap, scale, sinks = limits
    num_rows, num_tokens = group.token_ids.shape
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_slots.shape[0]
    heads_per_kv = num_q_heads // num_kv_heads
    keys_per_chunk = chunk_pages(page_size) * page_size
    num_chunks = group.pages.shape[1] // chunk_pages(page_size)
    # [rows, tokens, Hq, D] -> [Hk, rows, tokens * group, D]: a KV head's query rows together.
    queries = q[group.token_ids.flatten()].view(num_rows, num_tokens, num_kv_heads, heads_per_kv, head_dim)
    queries = queries.permute(2, 0, 1, 3, 4).reshape(num_kv_heads, num_rows, num_tokens * heads_per_kv, head_dim)
    queries = padded_rows(queries.float(), QUERY_ROW_TILE)
    num_query_rows = queries.shape[2]
    shape = (num_kv_heads, num_rows, num_chunks, keys_per_chunk, head_dim)
    keys = gather_pages(k_slots, group.pages, page_size, space, 0).view(shape).float()
    # [Hk, rows, 1, M, D] x [Hk, rows, chunks, D, C]: one [M, D] x [D, C] product per chunk.
    scores = torch.matmul(queries.unsqueeze(2), keys.transpose(-1, -2))
    scores.mul_(head_dim ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    # Each query row's position (padding rows repeat the last real one) against each key's.
    row_positions = group.positions.repeat_interleave(heads_per_kv, dim=1)
    row_positions = torch.cat([row_positions, row_positions[:, -1:].expand(-1, num_query_rows
                                                                            - row_positions.shape[1])], dim=1)
    key_positions = torch.arange(num_chunks * keys_per_chunk, device=q.device).view(num_chunks, 1, keys_per_chunk)
    query_positions = row_positions.view(num_rows, 1, num_query_rows, 1)
    hidden = key_positions > query_positions  # [rows, chunks, M, C]
    if window is not None:
        hidden |= query_positions - key_positions >= window
    scores.masked_fill_(hidden, float("-inf"))
    chunk_max = scores.amax(-1)  # [Hk, rows, chunks, M]; -inf for a chunk with no visible key
    finite_max = torch.where(torch.isinf(chunk_max), torch.zeros_like(chunk_max), chunk_max)
    weights = torch.exp(scores - finite_max.unsqueeze(-1))
    chunk_sum = weights.sum(-1)
    values = gather_pages(v_slots, group.pages, page_size, space, 1).view(shape).float()
    chunk_out = torch.matmul(weights, values)  # [Hk, rows, chunks, M, D]
    # Merge the chunks by log-sum-exp, summed in page order.
    top = chunk_max.amax(2, keepdim=True)
    chunk_weight = torch.exp(chunk_max - top)
    total = (chunk_sum * chunk_weight).cumsum(2)[:, :, -1]
    if sinks is not None:  # a query row's head: its KV head's (row % heads_per_kv)-th
        row_heads = torch.arange(num_query_rows, device=q.device) % heads_per_kv
        row_sinks = sinks.float().view(num_kv_heads, heads_per_kv)[:, row_heads].unsqueeze(1)
        total = total + torch.exp(row_sinks - top.squeeze(2))
    out = (chunk_out * chunk_weight.unsqueeze(-1)).cumsum(2)[:, :, -1] / total.unsqueeze(-1)
    out = out[:, :, :num_tokens * heads_per_kv].reshape(num_kv_heads, num_rows, num_tokens, heads_per_kv, head_dim)
    return out.permute(1, 2, 0, 3, 4).reshape(num_rows, num_tokens, num_q_heads, head_dim).to(q.dtype)


@dataclass(slots=True)
class InvariantBatch:
    """One step's attention, planned: the decode rows in groups of similar context length, each
    prefill chunk a group of its own. The flat layout's tokens are covered exactly once."""

    page_size: int
    write_slots: torch.Tensor  # [T]
    groups: list[InvariantGroup]
    space: GatherSpace | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_slots: torch.Tensor,
               v_slots: torch.Tensor, limits: Limits = NO_LIMITS) -> torch.Tensor:
        """Writes the step's new K/V (`[T, Hk, D]`) into the pool, then attends every query of `q`
        `[T, Hq, D]` -> `[T, Hq, D]`."""
        k_slots.index_copy_(1, self.write_slots, k.transpose(0, 1))
        v_slots.index_copy_(1, self.write_slots, v.transpose(0, 1))
        out = torch.empty_like(q)
        for group in self.groups:
            attended = attend_group(q, k_slots, v_slots, group, self.page_size, limits, self.space)
            out[group.token_ids.flatten()] = attended.flatten(0, 1)
        return out
