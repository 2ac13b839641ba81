"""The attention primitives every path uses: page gathers into reused buffers, decode attention
that also returns its log-sum-exp, and the exact merge of two partial attentions over disjoint
key sets.

K/V are head-major (`kv_pool.py`): a layer's K is `[kv_heads, num_slots, head_dim]`, so one page
of one head is `page_size * head_dim` contiguous values and a gather of pages yields each head's
keys already contiguous, `[kv_heads, rows, keys, head_dim]`: the layout batched matmuls read
without another copy.

Attention over keys K = K1 ∪ K2 (disjoint) equals the two partial results weighted by their
softmax mass: with lse_i = log Σ_{k∈K_i} exp(q·k·scale),
    out = (out_1 · e^{lse_1} + out_2 · e^{lse_2}) / (e^{lse_1} + e^{lse_2}),
computed in float32 around max(lse_1, lse_2) so that nothing overflows. This is what lets a shared
prefix be attended once for many queries (see `cascade.py`).
"""

from __future__ import annotations

import torch


class GatherSpace:
    """Two grow-only buffers (K and V) that page gathers copy into, reused by every layer and step.

    A fresh tensor per gather costs more than the copy itself: tens of MiB come from the
    allocator as new pages that the kernel must fault in and zero, every layer of every step.
    Invariant: what `gather_pages` returns is valid only until the next gather into the same
    buffer; every caller attends over it before gathering again.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]

    def take(self, which: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A contiguous `[numel]` view of buffer `which` (0: K, 1: V) in `like`'s dtype and device."""
        buffer = self._buffers[which]
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[which] = buffer
        return buffer[:numel]


def gather_pages(
    slots: torch.Tensor, pages: torch.Tensor, page_size: int,
    space: GatherSpace | None = None, which: int = 0,
) -> torch.Tensor:
    """Whole pages of a head-major pool: `[H, num_slots, D]`, pages `[...]` -> `[H, numel(pages) * page_size, D]`.

    Pages, not slots, are gathered: one `index_select` row is a page of one head
    (page_size * D contiguous values), which copies much faster than rows of one token.
    With `space`, the result lives in its buffer `which` (see `GatherSpace`).
    """
    num_heads, num_slots, head_dim = slots.shape
    by_page = slots.view(num_heads, num_slots // page_size, page_size * head_dim)
    flat = pages.flatten()
    if space is None:
        return by_page.index_select(1, flat).view(num_heads, -1, head_dim)
    out = space.take(which, num_heads * flat.numel() * page_size * head_dim, slots).view(num_heads, flat.numel(), -1)
    torch.index_select(by_page, 1, flat, out=out)
    return out.view(num_heads, -1, head_dim)


def attend_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention `[N, H, Lq, D]` x `[N, H, Lk, D]` -> (out `[N, H, Lq, D]`, lse `[N, H, Lq]` float32).

    `mask` is additive float32 and broadcasts to the scores' trailing dims `[..., Lq, Lk]`;
    `is_causal`: query i sees keys 0..i (queries and keys start at one position). Scores
    are float32 on every path. On CPU this is PyTorch's fused flash kernel, which returns the
    log-sum-exp it computed anyway. (Two batched bfloat16 matmuls around a float32 softmax read
    decode K/V faster, but round every score to bfloat16: the tiny bf16 model's decode logits then
    moved past the tolerance its test against transformers allows; docs/worker-backends.md.)
    Elsewhere, the plain math in float32, which is what this project's CUDA path needs at its sizes.
    """
    if q.device.type == "cpu":
        full_mask = None if mask is None else mask.view((1,) * (q.dim() - mask.dim()) + tuple(mask.shape))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=is_causal,
                                                                             attn_mask=full_mask)
        return out, lse
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)
    if mask is not None:
        scores.add_(mask)
    if is_causal:  # queries and keys from the same first position
        scores.masked_fill_(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                            float("-inf"))
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
