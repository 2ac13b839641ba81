"""Decode attention by a `DecodePlan`: each suffix bucket once, each shared prefix once per group.

Query heads of one KV group ride in the query-length axis (`[rows, kv_heads, group, D]`), so K/V
are never repeated for grouped-query attention. For a shared prefix the group's rows ride there
too: all `rows x group` query heads of a KV head meet the prefix's K/V in one kernel call, which
reads the prefix once instead of once per row. Results are merged by log-sum-exp in float32.
"""

from __future__ import annotations

import torch

from worker_service.attention.decode_plan import DecodePlan
from worker_service.attention.kernels import attend_with_lse, gather_pages, merge_by_lse


def _gather_kv(
    slots: tuple[torch.Tensor, torch.Tensor], pages: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `pages` ([N, P]) as `[N, kv_heads, P * page_size, D]` (transposed views)."""
    k_slots, v_slots = slots
    shape = (pages.shape[0], pages.shape[1] * page_size, k_slots.shape[1], k_slots.shape[2])
    keys = gather_pages(k_slots, pages, page_size).view(shape).transpose(1, 2)
    values = gather_pages(v_slots, pages, page_size).view(shape).transpose(1, 2)
    return keys, values


def decode_attention(
    q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, plan: DecodePlan, page_size: int
) -> torch.Tensor:
    """Attention of decode queries `q` `[B, Hq, D]` over their pages -> `[B, Hq, D]`."""
    num_rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k_slots.shape[1]
    group = num_q_heads // num_kv_heads
    queries = q.view(num_rows, num_kv_heads, group, head_dim)
    slots = (k_slots, v_slots)

    if len(plan.buckets) == 1 and plan.buckets[0].rows is None and not plan.prefixes:
        bucket = plan.buckets[0]  # every row in one bucket, nothing shared: no scatter, no merge
        out, _ = attend_with_lse(queries, *_gather_kv(slots, bucket.pages, page_size), bucket.mask)
        return out.view(num_rows, num_q_heads, head_dim)

    out = torch.empty_like(queries)
    lse = torch.empty(queries.shape[:-1], dtype=torch.float32, device=q.device)
    for bucket in plan.buckets:
        rows_q = queries if bucket.rows is None else queries.index_select(0, bucket.rows)
        part, part_lse = attend_with_lse(rows_q, *_gather_kv(slots, bucket.pages, page_size), bucket.mask)
        if bucket.rows is None:
            out, lse = part, part_lse
        else:
            out.index_copy_(0, bucket.rows, part)
            lse.index_copy_(0, bucket.rows, part_lse)

    for prefix in plan.prefixes:
        num_members = prefix.rows.shape[0]
        # [G, Hk, group, D] -> [1, Hk, G * group, D]: every member's heads of a KV head in one block.
        members = queries.index_select(0, prefix.rows)
        block = members.transpose(0, 1).reshape(1, num_kv_heads, num_members * group, head_dim)
        shared, shared_lse = attend_with_lse(block, *_gather_kv(slots, prefix.pages.unsqueeze(0), page_size), None)
        shared = shared.view(num_kv_heads, num_members, group, head_dim).transpose(0, 1)
        shared_lse = shared_lse.view(num_kv_heads, num_members, group).transpose(0, 1)
        merged = merge_by_lse(out.index_select(0, prefix.rows), lse.index_select(0, prefix.rows),
                              shared, shared_lse)
        out.index_copy_(0, prefix.rows, merged)
    return out.reshape(num_rows, num_q_heads, head_dim)
