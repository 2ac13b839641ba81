"""Decode attention by a `DecodePlan`: each suffix bucket once, each shared prefix once per group.

Everything is head-major (`[kv_heads, rows, ..., D]`, see `kernels.py`). Query heads of one KV
group ride in the query-length axis (`[kv_heads, rows, group, D]`), so K/V are never repeated
for grouped-query attention. For a shared prefix the group's rows ride there too: all
`rows x group` query heads of a KV head meet the prefix's K/V in one product, which reads the
prefix once instead of once per row. Results are merged by log-sum-exp in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_service.attention.decode_plan import DecodePlan
from worker_service.attention.kernels import GatherSpace, attend_with_lse, gather_pages, merge_by_lse


def _gather_kv(
    slots: tuple[torch.Tensor, torch.Tensor], pages: torch.Tensor, page_size: int, space: GatherSpace | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `pages` ([N, P]) as `[kv_heads, N, P * page_size, D]`."""
    k_slots, v_slots = slots
    shape = (k_slots.shape[0], pages.shape[0], pages.shape[1] * page_size, k_slots.shape[2])
    keys = gather_pages(k_slots, pages, page_size, space, 0).view(shape)
    values = gather_pages(v_slots, pages, page_size, space, 1).view(shape)
    return keys, values


def decode_attention(
    q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, plan: DecodePlan, page_size: int,
    space: GatherSpace | None = None,
) -> torch.Tensor:
    """Attention of decode queries `q` `[B, Hq, D]` over their pages -> `[B, Hq, D]`
    (`decode_attention_with_lse`'s output)."""
    return decode_attention_with_lse(q, k_slots, v_slots, plan, page_size, space)[0]


def decode_attention_with_lse(
    q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, plan: DecodePlan, page_size: int,
    space: GatherSpace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of decode queries `q` `[B, Hq, D]` over their pages -> (`[B, Hq, D]`, the
    log-sum-exp of each row's scores `[B, Hq]` float32).

    `k_slots` / `v_slots` are one layer's head-major pool, `[kv_heads, num_slots, D]`.
    """
    num_rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k_slots.shape[0]
    group = num_q_heads // num_kv_heads
    queries = q.view(num_rows, num_kv_heads, group, head_dim).transpose(0, 1)  # [Hk, B, group, D]
    slots = (k_slots, v_slots)

    if len(plan.buckets) == 1 and plan.buckets[0].rows is None and not plan.prefixes:
        bucket = plan.buckets[0]  # every row in one bucket, nothing shared: no scatter, no merge
        out, lse = attend_with_lse(queries, *_gather_kv(slots, bucket.pages, page_size, space), bucket.mask)
        return out.transpose(0, 1).reshape(num_rows, num_q_heads, head_dim), lse.transpose(0, 1).reshape(num_rows, -1)

    out = torch.empty_like(queries)
    lse = torch.empty(queries.shape[:-1], dtype=torch.float32, device=q.device)
    for bucket in plan.buckets:
        rows_q = queries if bucket.rows is None else queries.index_select(1, bucket.rows)
        part, part_lse = attend_with_lse(rows_q, *_gather_kv(slots, bucket.pages, page_size, space), bucket.mask)
        if bucket.rows is None:
            out, lse = part, part_lse
        else:
            out.index_copy_(1, bucket.rows, part)
            lse.index_copy_(1, bucket.rows, part_lse)

    for prefix in plan.prefixes:
        num_members = prefix.rows.shape[0]
        # [Hk, G, group, D] -> [Hk, 1, G * group, D]: every member's heads of a KV head in one block.
        block = queries.index_select(1, prefix.rows).reshape(num_kv_heads, 1, num_members * group, head_dim)
        shared, shared_lse = attend_with_lse(block, *_gather_kv(slots, prefix.pages.unsqueeze(0), page_size, space),
                                             None)
        own_lse, shared_lse = lse.index_select(1, prefix.rows), shared_lse.view(num_kv_heads, num_members, group)
        merged = merge_by_lse(out.index_select(1, prefix.rows), own_lse,
                              shared.view(num_kv_heads, num_members, group, head_dim), shared_lse)
        out.index_copy_(1, prefix.rows, merged)
        lse.index_copy_(1, prefix.rows, torch.logaddexp(own_lse, shared_lse))
    return out.transpose(0, 1).reshape(num_rows, num_q_heads, head_dim), lse.transpose(0, 1).reshape(num_rows, -1)


@dataclass(slots=True)
class CascadeDecode:
    """A step's decode rows attended by `plan` (the PyTorch backend's decode part of `paged.py`)."""

    plan: DecodePlan
    page_size: int
    space: GatherSpace | None = None

    @property
    def num_rows(self) -> int:
        return self.plan.num_rows

    def attend(self, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor) -> torch.Tensor:
        return decode_attention(q, k_slots, v_slots, self.plan, self.page_size, self.space)

    def attend_with_lse(self, q: torch.Tensor, k_slots: torch.Tensor,
                        v_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend`'s result and each row's log-sum-exp `[num_rows, Hq]` (float32)."""
        return decode_attention_with_lse(q, k_slots, v_slots, self.plan, self.page_size, self.space)
