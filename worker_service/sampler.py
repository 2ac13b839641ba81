"""Rank 0's sampler: one token per row of logits, vectorised over the batch.

Order of operations, per row:
    penalties (repetition, presence, frequency) -> temperature -> top_k / top_p / min_p -> draw.
Greedy rows (temperature 0) take the argmax of the penalised logits.

Reproducibility: a seeded row draws its noise from a generator seeded from
(seed, number of output tokens so far) and used for that row alone, so the token depends only on
the row's own logits, its seed and its step, never on what else shares the batch or on how the
request's steps were batched (or retracted and resumed). Unseeded rows share one generator.

Logprobs are the log-softmax of the RAW logits: the model's own distribution, before penalties,
temperature and truncation change it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20
_MASK64 = (1 << 64) - 1


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """One request's sampling settings with every default resolved.

    temperature 0 is greedy; top_k 0, top_p 1, min_p 0, repetition_penalty 1 and zero
    presence/frequency penalties switch those steps off. `seed` None means unseeded.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def problems(self) -> list[str]:
        """What is wrong with these values (empty when they are usable)."""
        found = []
        finite = {
            "temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        for name, value in finite.items():
            if value != value or value in (float("inf"), float("-inf")):
                found.append(f"{name} must be finite, got {value}")
        if self.temperature < 0:
            found.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            found.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            found.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            found.append(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            found.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            found.append(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.seed is not None and not 0 <= self.seed <= _MASK64:
            found.append(f"seed must fit in 64 unsigned bits, got {self.seed}")
        return found


@dataclass(slots=True, frozen=True)
class SampleRow:
    """What the sampler needs of one request this step.

    `token_ids` is the request's whole sequence so far (cached prefix, prompt and output tokens
    whose K/V is written); positions `[0, num_prompt_tokens)` are prompt, the rest output.
    """

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


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
    z = (seed + (num_output_tokens + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    """Draws tokens from a batch of logits; owns the generator shared by unseeded requests."""

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
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
        logits = apply_penalties(raw, rows)
        greedy_ids = logits.argmax(dim=-1)
        temperatures = torch.tensor(
            [row.params.temperature for row in rows], dtype=torch.float32, device=logits.device
        )
        is_random = temperatures > 0
        token_ids = greedy_ids
        if bool(is_random.any()):
            scaled = logits / torch.where(is_random, temperatures, 1.0).unsqueeze(1)
            probs = truncate(torch.softmax(scaled, dim=-1), rows)
            drawn = self._draw(probs, rows, is_random)
            token_ids = torch.where(is_random, drawn, greedy_ids)
        return _with_logprobs(raw, token_ids, rows)

    def _draw(self, probs: torch.Tensor, rows: list[SampleRow], is_random: torch.Tensor) -> torch.Tensor:
        """Exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. draws index i with prob p_i.

        Each seeded row fills its own noise from its own generator, so its draw does not
        depend on the other rows; unseeded rows share one generator.
        """
        noise = torch.empty_like(probs)
        unseeded = []
        for index, row in enumerate(rows):
            if not bool(is_random[index]):
                noise[index] = 1.0
            elif row.params.seed is None:
                unseeded.append(index)
            else:
                generator = torch.Generator(device=probs.device)
                generator.manual_seed(seed_for_step(row.params.seed, len(row.output_ids)))
                noise[index].exponential_(generator=generator)
        if unseeded:
            picked = torch.tensor(unseeded, device=probs.device)
            noise[picked] = torch.empty(
                (len(unseeded), probs.shape[1]), device=probs.device
            ).exponential_(generator=self._shared)
        # exponential_ can return exactly 0; a zero-probability token must still lose (0/0 = nan).
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition penalty on prompt + output tokens, then presence / frequency on output tokens.

    Repetition: a seen token's positive logit is divided by the penalty, a negative one
    multiplied. Presence / frequency: logit -= presence * [count > 0] + frequency * count.
    Returns a new tensor; rows without penalties are unchanged.
    """
    out = logits.clone()
    batch, vocab = logits.shape
    device = logits.device
    repetition = [row.params.repetition_penalty != 1.0 for row in rows]
    if any(repetition):
        seen = torch.zeros((batch, vocab), dtype=torch.bool, device=device)
        for index, row in enumerate(rows):
            if repetition[index] and row.token_ids:
                seen[index, torch.tensor(row.token_ids, device=device)] = True
        penalty = torch.tensor(
            [row.params.repetition_penalty for row in rows], dtype=out.dtype, device=device
        ).unsqueeze(1)
        penalised = torch.where(out > 0, out / penalty, out * penalty)
        out = torch.where(seen, penalised, out)
    additive = [row.params.presence_penalty != 0 or row.params.frequency_penalty != 0 for row in rows]
    if any(additive):
        counts = torch.zeros((batch, vocab), dtype=out.dtype, device=device)
        for index, row in enumerate(rows):
            outputs = row.output_ids
            if additive[index] and outputs:
                ids = torch.tensor(outputs, device=device)
                counts[index].index_add_(0, ids, torch.ones(len(outputs), dtype=out.dtype, device=device))
        presence = torch.tensor([row.params.presence_penalty for row in rows], dtype=out.dtype, device=device)
        frequency = torch.tensor([row.params.frequency_penalty for row in rows], dtype=out.dtype, device=device)
        out = out - presence.unsqueeze(1) * (counts > 0).to(out.dtype) - frequency.unsqueeze(1) * counts
    return out


def truncate(probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Zero the tokens that top_k, then top_p, then min_p exclude; renormalise.

    top_k keeps the k most likely tokens; top_p keeps the smallest most-likely set whose mass
    reaches p (the most likely token always stays); min_p keeps tokens with
    p >= min_p * max p. The most likely token survives all three, so no row is ever empty.
    """
    batch, vocab = probs.shape
    device = probs.device
    top_k = torch.tensor([row.params.top_k for row in rows], device=device)
    top_p = torch.tensor([row.params.top_p for row in rows], dtype=probs.dtype, device=device)
    min_p = torch.tensor([row.params.min_p for row in rows], dtype=probs.dtype, device=device)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if bool(((top_k > 0) & (top_k < vocab)).any()) or bool((top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device).unsqueeze(0)
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).unsqueeze(1)
        keep_sorted = rank < k
        kept_probs = sorted_probs * keep_sorted
        kept_probs = kept_probs / kept_probs.sum(dim=-1, keepdim=True)
        # Mass of the strictly more likely tokens: keep a token while that is still below p.
        mass_before = kept_probs.cumsum(dim=-1) - kept_probs
        keep_sorted &= (mass_before < top_p.unsqueeze(1)) | (rank == 0)
        keep = torch.zeros_like(keep).scatter(1, order, keep_sorted)
    if bool((min_p > 0).any()):
        best = probs.max(dim=-1, keepdim=True).values
        keep &= probs >= min_p.unsqueeze(1) * best
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


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
