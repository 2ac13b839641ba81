"""Rank 0's sampler: one token per row of logits, vectorised over the batch.

Order of operations, per row:
    penalties (repetition, presence, frequency) -> temperature -> top_k / top_p / min_p -> draw.
Greedy rows (temperature 0) take the argmax of the penalised logits.

Reproducibility: a seeded row draws its random number from a generator seeded from
(seed, number of output tokens so far) and used for that row alone, so the token depends only on
the row's own logits, its seed and its step, never on what else shares the batch or on how the
request's steps were batched (or retracted and resumed). Unseeded rows share one generator.

Where the compiled kernels run (CPU), the steps after the penalties run in `csrc/sample.cpp`, which
draws the same token as the torch path below for the same random number (the torch path stays for
other devices, and for rows the kernel leaves: a NaN or +inf, or nothing but -inf).

Logprobs are the log-softmax of the RAW logits: the model's own distribution, before penalties,
temperature and truncation change it. A constrained row's logits arrive already masked (see
grammar.py), so its logprobs are of the constrained distribution.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.sampling import SEED_MASK, SamplingParams

if TYPE_CHECKING:
    from worker_service.native import NativeKernels

# How many of a row's most likely tokens to rank before trying more, then all (see _keep_top).
CANDIDATE_WIDTHS = (256, 4096)


@dataclass(slots=True, frozen=True)
class SampleRow:
    """What the sampler needs of one request this step.

    `token_ids` is the request's whole sequence so far (cached prefix, prompt and output tokens
    whose K/V is written); positions `[0, num_prompt_tokens)` are prompt, the rest output.
    `history`, where given, holds the same ids as int32 from its start (it may run on, past
    `len(token_ids)`): the request state's own copy, which the compiled penalties read in place
    instead of converting the sequence every step.
    """

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    history: array | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """The seeded generator's step (counted, not sliced: a step costs no copy of the output)."""
        return max(0, len(self.token_ids) - self.num_prompt_tokens)


@dataclass(slots=True, frozen=True)
class Sample:
    """One drawn token; `logprob` and `top_logprobs` are filled only when asked for."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def seed_for_step(seed: int, num_output_tokens: int) -> int:
    """Mix (seed, step) into one 64-bit generator seed (splitmix64 finaliser).

    Nearby seeds and steps give unrelated streams, so step n of seed s never replays step
    n+1 of seed s-1.
    """
    z = (seed + (num_output_tokens + 1) * 0x9E3779B97F4A7C15) & SEED_MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & SEED_MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & SEED_MASK
    return z ^ (z >> 31)


class Sampler:
    """Draws tokens from a batch of logits; owns the generator shared by unseeded requests."""

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None,
                 kernels: NativeKernels | None = None) -> None:
        """`kernels`: the compiled kernels, which sample float32 rows on CPU (`csrc/sample.cpp`:
        the same distribution and draw as the torch path below, which took ~5 ms for 32 rows of
        49,152 logits here where the kernel takes a tenth of that)."""
        self.device = torch.device(device)
        self._kernels = kernels if self.device.type == "cpu" else None
        self._shared = torch.Generator(device=self.device)
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[Sample]:
        """One token per row of `logits` ([len(rows), vocab]), in row order."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if not rows:
            return []
        raw = logits.float()
        logits = self._penalise(raw, rows)
        is_random = [row.params.temperature > 0 for row in rows]
        if not any(is_random):
            return _with_logprobs(raw, self._argmax(logits), rows)
        uniform = self._uniform(rows, is_random)
        if self._kernels is None or logits.dtype != torch.float32:
            return _with_logprobs(raw, self._sample_torch(logits, rows, is_random, uniform), rows)
        token_ids = self._kernels.sample_rows(
            logits,
            torch.tensor([row.params.temperature for row in rows], dtype=torch.float32),
            torch.tensor([row.params.top_k for row in rows], dtype=torch.int32),
            torch.tensor([row.params.top_p for row in rows], dtype=torch.float32),
            torch.tensor([row.params.min_p for row in rows], dtype=torch.float32),
            uniform,
        )
        left = (token_ids < 0).nonzero().squeeze(1)
        if left.numel():  # rows with a NaN or +inf, or only -inf: the torch path's answer for them
            indices = left.tolist()
            token_ids[left] = self._sample_torch(
                logits[left], [rows[i] for i in indices], [is_random[i] for i in indices], uniform[left])
        return _with_logprobs(raw, token_ids, rows)

    def _penalise(self, raw: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """`apply_penalties`, by the compiled kernel where it runs (same result, float32 alike)."""
        penalised = [row.params.repetition_penalty != 1.0 or row.params.presence_penalty != 0
                     or row.params.frequency_penalty != 0 for row in rows]
        if self._kernels is None or raw.dtype != torch.float32 or not any(penalised):
            return apply_penalties(raw, rows)
        histories, keep_alive = [], []
        for row, wanted in zip(rows, penalised):
            if not wanted:
                histories.append((0, 0, 0))
                continue
            history = row.history if row.history is not None else array("i", row.token_ids)
            keep_alive.append(history)
            histories.append((history.buffer_info()[0], len(row.token_ids), row.num_prompt_tokens))
        out = raw.clone()
        self._kernels.apply_penalties(
            out, histories,
            torch.tensor([row.params.repetition_penalty for row in rows], dtype=torch.float32),
            torch.tensor([row.params.presence_penalty for row in rows], dtype=torch.float32),
            torch.tensor([row.params.frequency_penalty for row in rows], dtype=torch.float32),
        )
        return out

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax(logits, dim=-1), by the compiled kernel where it runs."""
        if self._kernels is not None and logits.dtype == torch.float32:
            token_ids = self._kernels.argmax_rows(logits)
            if token_ids is not None:
                return token_ids
        return logits.argmax(dim=-1)

    def _uniform(self, rows: list[SampleRow], is_random: list[bool]) -> torch.Tensor:
        """One uniform number in [0, 1) per row (float64; greedy rows get 0, unused).

        Each seeded row takes its number from its own generator, so its draw does not depend
        on the other rows; unseeded rows share one generator. One number per row (rather than
        noise over the whole vocabulary) keeps the draw cheap.
        """
        device = self.device
        uniform = torch.zeros(len(rows), dtype=torch.float64, device=device)
        unseeded = []
        for index, row in enumerate(rows):
            if not is_random[index]:
                continue
            if row.params.seed is None:
                unseeded.append(index)
            else:
                generator = torch.Generator(device=device)
                generator.manual_seed(seed_for_step(row.params.seed, row.num_output_tokens))
                uniform[index] = torch.rand(1, dtype=torch.float64, generator=generator, device=device)
        if unseeded:
            uniform[torch.tensor(unseeded, device=device)] = torch.rand(
                len(unseeded), dtype=torch.float64, generator=self._shared, device=device
            )
        return uniform

    def _sample_torch(self, logits: torch.Tensor, rows: list[SampleRow], is_random: list[bool],
                      uniform: torch.Tensor) -> torch.Tensor:
        """The tokens of penalised `logits` in PyTorch's ops (any device, any logits)."""
        # Greedy rows are divided by 1 and drawn from like the others, then replaced by their argmax.
        temperatures = torch.tensor(
            [row.params.temperature if random else 1.0 for row, random in zip(rows, is_random)],
            dtype=logits.dtype, device=logits.device,
        )
        probs = truncate(torch.softmax(logits / temperatures.unsqueeze(1), dim=-1), rows)
        token_ids = _draw(probs, uniform)
        if not all(is_random):
            greedy = torch.tensor([not random for random in is_random], device=logits.device)
            token_ids = torch.where(greedy, self._argmax(logits), token_ids)
        return token_ids


def _draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
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


def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, rows: list[SampleRow]) -> list[Sample]:
    ids = token_ids.tolist()
    wanted = [index for index, row in enumerate(rows) if row.params.logprobs or row.params.top_logprobs > 0]
    if not wanted:
        return [Sample(token_id=token) for token in ids]
    picked = torch.tensor(wanted, device=raw.device)
    logprobs = torch.log_softmax(raw[picked], dim=-1)
    chosen = logprobs.gather(1, token_ids[picked].unsqueeze(1)).squeeze(1).tolist()
    num_top = max(rows[index].params.top_logprobs for index in wanted)
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    samples = [Sample(token_id=token) for token in ids]
    for slot, index in enumerate(wanted):
        count = rows[index].params.top_logprobs
        top = None
        if count and top_values is not None:
            top = list(zip(top_ids[slot, :count].tolist(), top_values[slot, :count].tolist()))
        samples[index] = Sample(token_id=ids[index], logprob=chosen[slot], top_logprobs=top)
    return samples
