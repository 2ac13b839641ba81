"""The sampler's steps in PyTorch's ops: penalties, truncation and the draw (see `sampler.py`, `ops.py`).

They run on any device and for rows the compiled kernels leave; where the kernels run, they give
the same results (`csrc/penalties.cpp`, `csrc/sample.cpp`), and the tests hold the two to each other.
"""

from __future__ import annotations

import torch

from worker_service.sampling.rows import SampleRow

# How many of a row's most likely tokens to rank before trying more, then all (see _keep_top).
CANDIDATE_WIDTHS = (256, 4096)


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition penalty on prompt + output tokens, then presence / frequency on output tokens.

    Repetition: a seen token's positive logit is divided by the penalty, a negative one
    multiplied. Presence / frequency: logit -= presence * [count > 0] + frequency * count.
    Never changes `logits`: returns a penalised copy, or `logits` itself when no row has a
    penalty. Only the (row, token) pairs a penalty touches are read and written, never the whole
    [batch, vocab] tensor.
    """
    repeated = [(i, row.token_ids) for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    additive = [
        (i, row.output_ids) for i, row in enumerate(rows)
        if row.params.presence_penalty != 0 or row.params.frequency_penalty != 0
    ]
    if not repeated and not additive:
        return logits
    out = logits.clone()
    vocab = logits.shape[1]
    if repeated:
        row_ids, token_ids, _ = _pair_counts(repeated, vocab, out.device)
        penalty = torch.tensor([row.params.repetition_penalty for row in rows], dtype=out.dtype, device=out.device)
        values, factor = out[row_ids, token_ids], penalty[row_ids]
        out[row_ids, token_ids] = torch.where(values > 0, values / factor, values * factor)
    if additive:
        row_ids, token_ids, counts = _pair_counts(additive, vocab, out.device)
        presence = torch.tensor([row.params.presence_penalty for row in rows], dtype=out.dtype, device=out.device)
        frequency = torch.tensor([row.params.frequency_penalty for row in rows], dtype=out.dtype, device=out.device)
        out[row_ids, token_ids] -= presence[row_ids] + frequency[row_ids] * counts.to(out.dtype)
    return out


def _pair_counts(
    row_tokens: list[tuple[int, list[int]]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs as `(row_ids, token_ids, counts)`."""
    keys = torch.tensor(
        [row * vocab + token for row, tokens in row_tokens for token in tokens], dtype=torch.int64, device=device
    )
    distinct, counts = torch.unique(keys, return_counts=True)
    return distinct // vocab, distinct % vocab, counts


def truncate(probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Zero the tokens that top_k, then top_p, then min_p exclude; renormalise.

    top_k keeps the k most likely tokens; top_p keeps the smallest most-likely set whose mass
    (renormalised after top_k) reaches p; min_p keeps tokens with p >= min_p * max p. The most
    likely token survives all three, so no row is ever empty.
    """
    device = probs.device
    top_k = torch.tensor([row.params.top_k for row in rows], device=device)
    top_p = torch.tensor([row.params.top_p for row in rows], dtype=probs.dtype, device=device)
    min_p = torch.tensor([row.params.min_p for row in rows], dtype=probs.dtype, device=device)
    if not any(r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0 for r in rows):
        return probs
    keep = _keep_top(probs, top_k, top_p)
    if bool((min_p > 0).any()):
        best = probs.max(dim=-1, keepdim=True).values
        keep &= probs >= min_p.unsqueeze(1) * best
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


def _keep_top(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The top_k-then-top_p mask, sorting as little as possible.

    A full sort of a [batch, vocab] tensor dominates sampling time, so rows are first ranked
    over their few most likely tokens only (`topk`), then over more, then over all. A ranking
    of width w decides a row exactly when the row's top_k fits in w, or when its w most likely
    tokens already hold top_p of its mass; each wider pass handles only the undecided rows.
    """
    batch, vocab = probs.shape
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    active = ((k < vocab) | (top_p < 1)).nonzero().squeeze(1)
    if active.numel() == 0:
        return torch.ones_like(probs, dtype=torch.bool)
    everyone = active.numel() == batch
    if not everyone:
        probs, k, top_p = probs[active], k[active], top_p[active]
    # Rows without top_k renormalise over the whole vocabulary, not just the ranked tokens.
    totals = torch.where(k < vocab, 0.0, probs.sum(dim=-1))
    limited = k[k < vocab]
    narrowest = max(CANDIDATE_WIDTHS[0], int(limited.max()) if limited.numel() else 0)
    widths = sorted({min(vocab, w) for w in (narrowest, *CANDIDATE_WIDTHS[1:], vocab) if w >= narrowest})
    rows_keep: torch.Tensor | None = None  # made by the first pass that leaves rows undecided
    pending = torch.arange(len(active), device=probs.device)
    for width in widths:
        # While every row is pending (the first pass) the rows are read in place, and where every
        # row is decided its mask is made whole: copies of the whole batch cost more than the
        # ranking's other steps together.
        whole = pending.numel() == probs.shape[0]
        sub = probs if whole else probs[pending]
        values, order = sub.topk(width, dim=-1) if width < vocab else sub.sort(dim=-1, descending=True)
        keep_sorted, mass = _keep_sorted(values, k[pending], top_p[pending], totals[pending])
        # At full width every row is decided: k <= vocab always.
        decided = (k[pending] <= width) | (mass >= top_p[pending])
        if bool(decided.all()):
            chosen = torch.zeros_like(sub, dtype=torch.bool).scatter_(1, order, keep_sorted)
            if whole:
                rows_keep = chosen
            else:  # an earlier pass left these rows undecided, and made rows_keep
                rows_keep[pending] = chosen
            break
        if rows_keep is None:
            rows_keep = torch.zeros_like(probs, dtype=torch.bool)
        rows = pending[decided]
        rows_keep[rows] = torch.zeros_like(sub[decided], dtype=torch.bool).scatter(
            1, order[decided], keep_sorted[decided]
        )
        pending = pending[~decided]  # not empty: a pass deciding every row ends the loop above
    if everyone:
        return rows_keep
    keep = torch.ones((batch, vocab), dtype=torch.bool, device=rows_keep.device)
    keep[active] = rows_keep
    return keep


def _keep_sorted(
    values: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, totals: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep mask over probabilities sorted descending, and the renormalised mass they hold.

    `totals` is each row's normaliser when it is not simply the mass of its top k (rows with
    top_k pass 0 and are normalised over their kept values).
    """
    rank = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
    keep = rank < k.unsqueeze(1)
    kept = values * keep
    total = torch.where(totals > 0, totals, kept.sum(dim=-1))
    kept = kept / total.unsqueeze(1)
    cumulative = kept.cumsum(dim=-1)
    # Keep a token while the mass of the strictly more likely tokens is still below p.
    keep &= (cumulative - kept < top_p.unsqueeze(1)) | (rank == 0)
    return keep, cumulative[:, -1]


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: each row's uniform number located in the row's cumulative probs."""
    cumulative = probs.cumsum(dim=-1)
    targets = (uniform.to(cumulative.dtype) * cumulative[:, -1]).unsqueeze(1)
    # right=True: the first token whose cumulative mass passes the target, so a zero-probability
    # token (a flat step) is never chosen, even for a target of exactly 0.
    drawn = torch.searchsorted(cumulative, targets, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
    # Rounding can put the target at the very top, past the last allowed token; move it back.
    overshot = (probs.gather(1, drawn.unsqueeze(1)).squeeze(1) == 0).nonzero().squeeze(1)
    if overshot.numel():
        positions = torch.arange(probs.shape[1], device=probs.device)
        allowed = probs[overshot] > 0
        drawn[overshot] = torch.where(allowed, positions, 0).max(dim=-1).values
    return drawn
