"""Paged attention: K/V are written to and read from the pool only through page tables.

A forward pass lays its tokens out decode-first: the single-token entries (decode steps) come
first, one token each, then each prefill chunk as a contiguous span. Per layer:

1. the new tokens' K/V are written into their slots with one `index_copy_` per pool (head-major:
   `[kv_heads, num_slots, head_dim]`, see `kernels.py`);
2. the decode tokens attend by the step's `DecodePlan` (`cascade.py`): shared prefixes once per
   group, each entry's own suffix in length buckets, merged by log-sum-exp;
3. each prefill chunk attends on its own: a chunk starting at position 0 uses its fresh K/V with
   the plain causal kernel (the fast path); a chunk starting later gathers its context's pages
   from the pool and uses a causal mask shifted by its start position.

Which physical pages hold a sequence cannot change the result: only gather indices differ.

Step 2 is whatever the backend planned (`AttentionBatch.decode`): the cascade above on the
PyTorch backend, one Triton kernel reading every decode row through its page table on CUDA
(`gpu_decode.py`). The compiled CPU kernels attend every row in one call and do not use this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from worker_service.attention.kernels import GatherSpace, attend_with_lse, gather_pages


class DecodeAttention(Protocol):
    """The decode rows of one step, planned: `attend` takes their queries `[num_rows, Hq, D]` over
    one layer's head-major pool and returns `[num_rows, Hq, D]` (their K/V already written)."""

    @property
    def num_rows(self) -> int: ...

    def attend(self, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor) -> torch.Tensor: ...


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

    The first `decode.num_rows` tokens of the flat layout are single-token decode entries
    (`decode` is None when there are none); `prefills` follow. `space` holds the gathered pages
    of one attention call at a time; it outlives the step (see `GatherSpace`).
    """

    page_size: int
    write_slots: torch.Tensor  # [T]: slot of each token of the flat layout
    decode: DecodeAttention | None
    prefills: list[PrefillSpan]
    space: GatherSpace | None = None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    batch: AttentionBatch,
    stored: bool = False,
) -> torch.Tensor:
    """Attention for the flat layout: q [T, Hq, D], k/v [T, Hk, D] -> [T, Hq, D].

    `k_slots` / `v_slots` are this layer's head-major pool, `[Hk, num_slots, D]`; the new K/V are
    stored there before anything is read (unless `stored`: the caller has written them).
    """
    if not stored:
        k_slots.index_copy_(1, batch.write_slots, k.transpose(0, 1))
        v_slots.index_copy_(1, batch.write_slots, v.transpose(0, 1))
    group_size = q.shape[1] // k.shape[1]
    parts: list[torch.Tensor] = []  # outputs in flat-layout order: decode block, then each span
    if batch.decode is not None:
        parts.append(batch.decode.attend(q[: batch.decode.num_rows], k_slots, v_slots))

    for span in batch.prefills:
        queries = q[span.token_start:span.token_stop].transpose(0, 1).unsqueeze(0)
        if span.context_pages is None:
            keys = k[span.token_start:span.token_stop].transpose(0, 1)
            values = v[span.token_start:span.token_stop].transpose(0, 1)
        else:  # [Hk, context, D], already head-major
            keys = gather_pages(k_slots, span.context_pages, batch.page_size, batch.space, 0)
            values = gather_pages(v_slots, span.context_pages, batch.page_size, batch.space, 1)
        keys, values = keys.unsqueeze(0), values.unsqueeze(0)
        attended = F.scaled_dot_product_attention(
            queries, keys, values,
            attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=group_size > 1,
        )
        parts.append(attended.squeeze(0).transpose(0, 1))
    # One part (all decode, or one prompt) is the common step: no copy then.
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def paged_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
    batch: AttentionBatch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`paged_attention`'s output for the flat layout (the step's K/V `k`, `v` already stored), and the
    log-sum-exp of each query's scores `[T, Hq]` (float32): what attention sinks need
    (`backends/torch_backend.py`). The decode rows must be planned as a cascade
    (`CascadeDecode.attend_with_lse`); each prefill chunk attends with its log-sum-exp, its KV
    heads repeated for their query heads."""
    group_size = q.shape[1] // k_slots.shape[0]
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []
    if batch.decode is not None:
        out, lse = batch.decode.attend_with_lse(q[: batch.decode.num_rows], k_slots, v_slots)
        outs.append(out)
        lses.append(lse)
    for span in batch.prefills:
        queries = q[span.token_start:span.token_stop].transpose(0, 1).unsqueeze(0)
        if span.context_pages is None:  # from position 0: its own fresh keys, causal
            keys = k[span.token_start:span.token_stop].transpose(0, 1)
            values = v[span.token_start:span.token_stop].transpose(0, 1)
            mask = None
        else:
            keys = gather_pages(k_slots, span.context_pages, batch.page_size, batch.space, 0)
            values = gather_pages(v_slots, span.context_pages, batch.page_size, batch.space, 1)
            mask = span.mask
        keys = keys.repeat_interleave(group_size, dim=0).unsqueeze(0)
        values = values.repeat_interleave(group_size, dim=0).unsqueeze(0)
        out, lse = attend_with_lse(queries, keys, values, mask, is_causal=mask is None)
        outs.append(out.squeeze(0).transpose(0, 1))
        lses.append(lse.squeeze(0).transpose(0, 1))
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses)
