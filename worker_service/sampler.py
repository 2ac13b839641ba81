"""Rank 0's sampler: one token per row of logits, vectorised over the batch.

Order of operations, per row:
    penalties (repetition, presence, frequency) -> temperature -> top_k / top_p / min_p -> draw.
Greedy rows (temperature 0) take the argmax of the penalised logits.

Reproducibility: a seeded row draws its random number from a generator seeded from
(seed, number of output tokens so far) and used for that row alone, so the token depends only on
the row's own logits, its seed and its step, never on what else shares the batch or on how the
request's steps were batched (or retracted and resumed). Unseeded rows share one generator.

Where the compiled kernels run (CPU), every step runs in them (`csrc/penalties.cpp`; `csrc/sample.cpp`: the
same token as the torch path in `sampling_torch.py` for the same random number; `csrc/logprobs.cpp`);
the torch path stays for other devices, and for rows the kernels leave (a NaN or +inf logit, or
nothing but -inf).

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
from worker_service.sampling_torch import apply_penalties, draw, truncate

if TYPE_CHECKING:
    from worker_service.native import NativeKernels

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
        """`kernels`: the compiled kernels, which penalise, sample and take logprobs of float32 rows
        on CPU (`native_sampling.py`: the same results as the torch path, which took ~5 ms to
        sample 32 rows of 49,152 logits here where the kernel takes a tenth of that)."""
        self.device = torch.device(device)
        self._kernels = kernels.sampling if kernels is not None and self.device.type == "cpu" else None
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
            return self._with_logprobs(raw, self._argmax(logits), rows)
        uniform = self._uniform(rows, is_random)
        if self._kernels is None:
            return self._with_logprobs(raw, self._sample_torch(logits, rows, is_random, uniform), rows)
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
        return self._with_logprobs(raw, token_ids, rows)

    def _penalise(self, raw: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """`apply_penalties`, by the compiled kernel where it runs (same result, float32 alike)."""
        penalised = [row.params.has_penalties for row in rows]
        if self._kernels is None or not any(penalised):
            return apply_penalties(raw, rows)
        histories, keep_alive = [], []  # keep_alive: the arrays made here live until the call returns
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
        if self._kernels is not None:
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
        token_ids = draw(probs, uniform)
        if not all(is_random):
            greedy = torch.tensor([not random for random in is_random], device=logits.device)
            token_ids = torch.where(greedy, self._argmax(logits), token_ids)
        return token_ids

    def _with_logprobs(self, raw: torch.Tensor, token_ids: torch.Tensor, rows: list[SampleRow]) -> list[Sample]:
        """The samples of `token_ids`, with the logprobs and top logprobs their rows ask for (of
        the raw logits: see the module docstring)."""
        ids = token_ids.tolist()
        wanted = [index for index, row in enumerate(rows) if row.params.logprobs or row.params.top_logprobs > 0]
        if not wanted:
            return [Sample(token_id=token) for token in ids]
        picked = torch.tensor(wanted, device=raw.device)
        num_top = max(rows[index].params.top_logprobs for index in wanted)
        computed = None
        if self._kernels is not None:
            computed = self._kernels.logprobs(raw, picked, token_ids[picked].contiguous(), num_top)
        if computed is not None:
            chosen, top_ids, top_values = computed
        else:
            logprobs = torch.log_softmax(raw[picked], dim=-1)
            chosen = logprobs.gather(1, token_ids[picked].unsqueeze(1)).squeeze(1)
            top_values, top_ids = logprobs.topk(num_top, dim=-1)
        chosen = chosen.tolist()
        samples = [Sample(token_id=token) for token in ids]
        for slot, index in enumerate(wanted):
            count = rows[index].params.top_logprobs
            top = None
            if count:
                top = list(zip(top_ids[slot, :count].tolist(), top_values[slot, :count].tolist()))
            samples[index] = Sample(token_id=ids[index], logprob=chosen[slot], top_logprobs=top)
        return samples
