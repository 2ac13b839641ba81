"""Rank 0's sampler: one token per row of logits, vectorised over the batch.

Order of operations, per row:
    penalties (repetition, presence, frequency) -> logit bias -> temperature
    -> top_k / top_p / min_p -> draw.
Greedy rows (temperature 0) take the argmax of the penalised and biased logits.

Reproducibility: a seeded row draws its random number from a generator seeded from
(seed, number of output tokens so far) and used for that row alone, so the token depends only on
the row's own logits, its seed and its step, never on what else shares the batch or on how the
request's steps were batched (or retracted and resumed). Unseeded rows share one generator.

Where the compiled kernels run (CPU), every step runs in them, with the same results as PyTorch's
ops; `ops.py` holds both and the one place where rows the kernels refuse go to PyTorch.

Logprobs are the log-softmax of the RAW logits: the model's own distribution, before penalties,
temperature, logit bias and truncation change it. A constrained row's logits arrive already masked (see
grammar.py), so its logprobs are of the constrained distribution, and its top logprobs hold only the
tokens it allows: where it allows fewer than were asked for (one forced token), the list is shorter,
never padded with tokens of probability 0 (-inf, which JSON cannot carry).
"""

from __future__ import annotations

import torch

from radixserve.sampling import SEED_MASK
from worker_service.native import NativeKernels
from worker_service.sampling.kernels import SamplingKernels
from worker_service.sampling.ops import CpuSampling, KernelSampling, TorchSampling
from worker_service.sampling.rows import Sample, SampleRow


NEGATIVE_INFINITY = float("-inf")


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
        on CPU (`ops.KernelSampling`); PyTorch's ops otherwise (on CPU with NumPy's argmax)."""
        self.device = torch.device(device)
        if self.device.type != "cpu":
            self._ops = TorchSampling()
        elif kernels is not None:
            self._ops = KernelSampling(SamplingKernels(kernels.lib))
        else:
            self._ops = CpuSampling()
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
            return self._with_logprobs(raw, self._ops.argmax(logits), rows)
        uniform = self._uniform(rows, is_random)
        return self._with_logprobs(raw, self._ops.sample(logits, rows, is_random, uniform), rows)

    def _penalise(self, raw: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The rows' penalties, then their logit biases, applied to `raw` (a copy where any row
        has either)."""
        logits = self._ops.penalise(raw, rows)
        biased = [(index, row.params.logit_bias) for index, row in enumerate(rows) if row.params.logit_bias]
        if not biased:
            return logits
        if logits is raw:
            logits = raw.clone()
        row_index = [index for index, bias in biased for _ in bias]
        token_ids = [token_id for _, bias in biased for token_id, _ in bias]
        values = [value for _, bias in biased for _, value in bias]
        device = logits.device
        logits.index_put_(
            (torch.tensor(row_index, device=device), torch.tensor(token_ids, device=device)),
            torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True,
        )
        return logits

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

    def _with_logprobs(self, raw: torch.Tensor, token_ids: torch.Tensor, rows: list[SampleRow]) -> list[Sample]:
        """The samples of `token_ids`, with the logprobs and top logprobs their rows ask for (of
        the raw logits: see the module docstring)."""
        ids = token_ids.tolist()
        wanted = [index for index, row in enumerate(rows) if row.params.logprobs or row.params.top_logprobs > 0]
        if not wanted:
            return [Sample(token) for token in ids]
        picked = torch.tensor(wanted, device=raw.device)
        num_top = max(rows[index].params.top_logprobs for index in wanted)
        chosen, top_ids, top_values = self._ops.logprobs(raw, picked, token_ids[picked], num_top)
        chosen = chosen.tolist()
        samples = [Sample(token) for token in ids]
        for slot, index in enumerate(wanted):
            count = rows[index].params.top_logprobs
            top = None
            if count:
                top = [(token, value) for token, value in zip(top_ids[slot, :count].tolist(),
                                                              top_values[slot, :count].tolist())
                       if value != NEGATIVE_INFINITY]
            samples[index] = Sample(token_id=ids[index], logprob=chosen[slot], top_logprobs=top)
        return samples
