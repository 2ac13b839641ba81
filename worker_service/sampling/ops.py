"""The sampler's four batched steps, each in PyTorch's ops (`TorchSampling`; on CPU without the
compiled kernels `CpuSampling`, which takes the argmax with NumPy) or in the compiled kernels
(`KernelSampling`); the `Sampler` is given one of them and never asks which.

`KernelSampling` is the one place where rows the kernels refuse (a NaN or +inf logit, nothing but
-inf) go to PyTorch: the kernels give the same results as the torch path for every other row
(`csrc/sample.cpp` draws the same token for the same random number), and the tests hold them to it.
"""

from __future__ import annotations

from array import array

import torch

from worker_service.sampling.kernels import SamplingKernels
from worker_service.sampling.rows import SampleRow
from worker_service.sampling.torch_ops import apply_penalties, draw, truncate

# (chosen tokens' logprobs [n], top ids [n, k], top logprobs [n, k])
Logprobs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class TorchSampling:
    """The steps in PyTorch's ops: any device, any logits."""

    def penalise(self, raw: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """`raw` with the rows' penalties applied (a copy where any row has one; see `apply_penalties`)."""
        return apply_penalties(raw, rows)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow], is_random: list[bool],
               uniform: torch.Tensor) -> torch.Tensor:
        """One token per row of penalised `logits`: drawn with `uniform` where `is_random`, else the argmax."""
        # Greedy rows are divided by 1 and drawn from like the others, then replaced by their argmax.
        temperatures = torch.tensor(
            [row.params.temperature if random else 1.0 for row, random in zip(rows, is_random)],
            dtype=logits.dtype, device=logits.device,
        )
        probs = truncate(torch.softmax(logits / temperatures.unsqueeze(1), dim=-1), rows)
        token_ids = draw(probs, uniform)
        if not all(is_random):
            greedy = torch.tensor([not random for random in is_random], device=logits.device)
            token_ids = torch.where(greedy, self.argmax(logits), token_ids)
        return token_ids

    def logprobs(self, raw: torch.Tensor, picked: torch.Tensor, chosen: torch.Tensor, num_top: int) -> Logprobs:
        """Log-softmax of rows `raw[picked]` at tokens `chosen`, and each row's `num_top` best."""
        logprobs = torch.log_softmax(raw[picked], dim=-1)
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        return logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1), top_ids, top_values


class CpuSampling(TorchSampling):
    """PyTorch's ops on CPU logits, but the argmax is NumPy's: the same answer (the first index of
    the maximum; a NaN counts as the maximum) from a vectorised loop, where PyTorch's CPU argmax
    reads the row one element at a time (docs/benchmarks.md has both measured)."""

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))


class KernelSampling(TorchSampling):
    """The steps in the compiled kernels (float32 CPU logits), PyTorch's for the rows they refuse."""

    def __init__(self, kernels: SamplingKernels) -> None:
        self._kernels = kernels

    def penalise(self, raw: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        penalised = [row.params.has_penalties for row in rows]
        if not any(penalised):
            return raw
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

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        token_ids = self._kernels.argmax_rows(logits)
        return super().argmax(logits) if token_ids is None else token_ids  # refused: a NaN somewhere

    def sample(self, logits: torch.Tensor, rows: list[SampleRow], is_random: list[bool],
               uniform: torch.Tensor) -> torch.Tensor:
        token_ids = self._kernels.sample_rows(
            logits,
            torch.tensor([row.params.temperature for row in rows], dtype=torch.float32),
            torch.tensor([row.params.top_k for row in rows], dtype=torch.int32),
            torch.tensor([row.params.top_p for row in rows], dtype=torch.float32),
            torch.tensor([row.params.min_p for row in rows], dtype=torch.float32),
            uniform,
        )
        left = (token_ids < 0).nonzero().squeeze(1)
        if left.numel():  # refused rows (a NaN or +inf, or only -inf): the torch path's answer for them
            indices = left.tolist()
            token_ids[left] = super().sample(
                logits[left], [rows[i] for i in indices], [is_random[i] for i in indices], uniform[left])
        return token_ids

    def logprobs(self, raw: torch.Tensor, picked: torch.Tensor, chosen: torch.Tensor, num_top: int) -> Logprobs:
        computed = self._kernels.logprobs(raw, picked, chosen.contiguous(), num_top)
        return super().logprobs(raw, picked, chosen, num_top) if computed is None else computed
