"""The attention primitives every path uses: page gathers, attention that also returns its
log-sum-exp, and the exact merge of two partial attentions over disjoint key sets.

Attention over keys K = K1 ∪ K2 (disjoint) equals the two partial results weighted by their
softmax mass: with lse_i = log Σ_{k∈K_i} exp(q·k·scale),
    out = (out_1 · e^{lse_1} + out_2 · e^{lse_2}) / (e^{lse_1} + e^{lse_2}),
computed in float32 around max(lse_1, lse_2) so that nothing overflows. This is what lets a shared
prefix be attended once for many queries (see `cascade.py`).
"""

from __future__ import annotations

import torch


def gather_pages(slots: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Rows of whole pages: `[num_slots, H, D]` pool, pages `[...]` -> `[numel(pages) * page_size, H, D]`.

    Pages, not slots, are gathered: `index_select` over rows of one page (page_size * H * D values)
    copies about twice as fast as over rows of one token.
    """
    by_page = slots.view(slots.shape[0] // page_size, -1)
    return by_page.index_select(0, pages.flatten()).view(-1, *slots.shape[1:])


def attend_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention `[N, H, Lq, D]` x `[N, H, Lk, D]` -> (out `[N, H, Lq, D]`, lse `[N, H, Lq]` float32).

    `mask` is additive and broadcasts to `[N, H, Lq, Lk]`. On CPU this is PyTorch's fused flash
    kernel, which returns the log-sum-exp it computed anyway; elsewhere the plain math (float32
    scores), which is what this project's CUDA path needs at its sizes.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask)
        return out, lse
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(weights, v.float()).to(q.dtype), lse


def merge_by_lse(
    out_1: torch.Tensor, lse_1: torch.Tensor, out_2: torch.Tensor, lse_2: torch.Tensor
) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from the two partial results.

    `out_*` are `[..., D]` in the model dtype, `lse_*` the matching `[...]` float32 log-sum-exps.
    Returns the merged output in `out_1`'s dtype.
    """
    top = torch.maximum(lse_1, lse_2)
    weight_1 = torch.exp(lse_1 - top).unsqueeze(-1)
    weight_2 = torch.exp(lse_2 - top).unsqueeze(-1)
    merged = (out_1.float() * weight_1 + out_2.float() * weight_2) / (weight_1 + weight_2)
    return merged.to(out_1.dtype)
