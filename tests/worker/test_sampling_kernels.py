"""Rank 0's sampling kernels (`csrc/sample.cpp`, `penalties.cpp`, `logprobs.cpp`) against the
sampler's torch path: the same tokens for the same random numbers, the same penalised logits, the
same logprobs; rows they cannot take (NaN, +inf, nothing but -inf) left to the torch path; and the
greedy argmax against torch.argmax."""

from __future__ import annotations

import math
from array import array

import pytest
import torch

from radixserve.sampling import SamplingParams
from worker_service.sampling import Sampler, SampleRow
from worker_service.sampling.torch_ops import apply_penalties, truncate

from worker.sampling_helpers import KERNEL, SAMPLING, assert_logprobs, needs_kernel, row

pytestmark = needs_kernel


def kernel_and_torch_tokens(logits: torch.Tensor, rows: list[SampleRow], seed: int) -> tuple[list[int], list[int]]:
    """Tokens from both samplers with the same uniform numbers (the same shared generator seed)."""
    compiled = Sampler("cpu", seed=seed, kernels=KERNEL).sample(logits, rows)
    plain = Sampler("cpu", seed=seed).sample(logits, rows)
    return [s.token_id for s in compiled], [s.token_id for s in plain]


@pytest.mark.parametrize("vocab", [7, 16, 33, 1000, 49152])
@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])
def test_kernel_draws_the_torch_paths_tokens(vocab: int, scale: float) -> None:
    """Every combination of the truncations, several temperatures and levels of peakedness, some
    rows partly masked to -inf (as constrained rows are) and greedy rows among them: the same token
    for the same uniform number, row by row."""
    generator = torch.Generator().manual_seed(vocab * 31 + int(scale * 10))
    configs = [
        SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
        for t in (0.05, 0.7, 1.0, 1.9) for k in (0, 1, 5, 60, 2000) for p in (1.0, 0.95, 0.5) for m in (0.0, 0.02, 0.4)
    ] + [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_k=3)]
    rows = [row(params) for params in configs]
    logits = torch.randn(len(rows), vocab, generator=generator) * scale
    masked = torch.rand(len(rows), vocab, generator=generator) < 0.3
    masked[::2] = False  # every other row unmasked
    masked[:, 0] = False  # never a row of nothing but -inf here
    logits[masked] = float("-inf")
    compiled, plain = kernel_and_torch_tokens(logits, rows, seed=vocab)
    differ = [(i, configs[i], compiled[i], plain[i]) for i in range(len(rows)) if compiled[i] != plain[i]]
    assert not differ
    assert all(not masked[i, token] for i, token in enumerate(compiled))


def test_kernel_leaves_non_finite_rows_to_torch() -> None:
    """A NaN, a +inf, a row of nothing but -inf: those rows take the torch path's answer, the other
    rows still the kernel's, and the result is the torch path's throughout."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(2)) * 2
    logits[1, 17] = float("nan")
    logits[2, 40] = float("inf")
    logits[3] = float("-inf")
    params = SamplingParams(temperature=0.8, top_p=0.9)
    rows = [row(params)] * 6
    uniform = torch.rand(6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    direct = SAMPLING.sample_rows(logits, torch.full((6,), 0.8), torch.zeros(6, dtype=torch.int32),
                                torch.full((6,), 0.9), torch.zeros(6), uniform)
    assert direct[[1, 2, 3]].tolist() == [-1, -1, -1] and bool((direct[[0, 4, 5]] >= 0).all())
    compiled, plain = kernel_and_torch_tokens(logits, rows, seed=4)
    assert compiled == plain


def test_kernel_rejects_mismatched_parameters() -> None:
    logits = torch.zeros(2, 10)
    ones = torch.ones(2)
    with pytest.raises(TypeError, match="top_k"):
        SAMPLING.sample_rows(logits, ones, torch.zeros(2), ones, torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="uniform"):
        SAMPLING.sample_rows(logits, ones, torch.zeros(2, dtype=torch.int32), ones, torch.zeros(2), torch.zeros(3))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.6, top_k=40), SamplingParams(temperature=1.0, min_p=0.1)])
def test_kernel_draws_follow_the_distribution(params: SamplingParams) -> None:
    """Many draws from one flat-ish row of 40,000 logits (the ranking needs its lower levels): each
    token's frequency within 5 sigma of its truncated, renormalised probability."""
    vocab, num_draws = 40_000, 3000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(9)) * 1.5
    logits[0, :4] = torch.tensor([9.0, 8.5, 8.0, 7.0])  # a few likely tokens, a long tail
    probs = truncate(torch.softmax(logits.double() / params.temperature, dim=-1), [row(params)])[0]
    samples = Sampler("cpu", seed=3, kernels=KERNEL).sample(logits.repeat(num_draws, 1), [row(params)] * num_draws)
    drawn = torch.bincount(torch.tensor([s.token_id for s in samples]), minlength=vocab).double() / num_draws
    assert bool((probs[drawn > 0] > 0).all()), "a token outside the truncated set was drawn"
    for token in range(4):
        expected = float(probs[token])
        sigma = math.sqrt(expected * (1 - expected) / num_draws)
        assert abs(float(drawn[token]) - expected) < 5 * sigma + 1e-3
    tail = float(probs[4:].sum())
    sigma = math.sqrt(tail * (1 - tail) / num_draws)
    assert abs(float(drawn[4:].sum()) - tail) < 5 * sigma + 1e-3


@pytest.mark.parametrize("given_history", [False, True])
def test_kernel_penalties_equal_the_torch_paths(given_history: bool) -> None:
    """Repetition, presence and frequency penalties alone and together, tokens repeated within the
    prompt, within the output and across both, rows without penalties among them: the same float32
    logits as `apply_penalties`. With `given_history`, rows read the ids from an int32 copy that
    runs on past their own sequence (a draft row's prefix of the request state's copy)."""
    rng = torch.Generator().manual_seed(5)
    vocab = 3000
    logits = torch.randn(12, vocab, generator=rng) * 4
    variants = [SamplingParams(), SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.7),
                SamplingParams(presence_penalty=0.6), SamplingParams(frequency_penalty=0.35),
                SamplingParams(presence_penalty=-0.4, frequency_penalty=1.25, repetition_penalty=1.1)]
    rows = []
    for index in range(12):
        length = int(torch.randint(1, 400, (1,), generator=rng))
        tokens = torch.randint(0, 60 if index % 3 else vocab, (length,), generator=rng).tolist()  # many repeats
        num_prompt = int(torch.randint(0, length + 1, (1,), generator=rng))
        history = array("i", tokens + [7, 8, 9]) if given_history else None
        rows.append(SampleRow(variants[index % len(variants)], tokens, num_prompt, history))
    expected = apply_penalties(logits, rows)
    got = Sampler("cpu", kernels=KERNEL)._penalise(logits, rows)
    assert torch.equal(got, expected)
    assert got.data_ptr() != logits.data_ptr()  # a penalised copy; the raw logits stay for logprobs


def test_kernel_penalties_refuse_token_ids_outside_the_vocabulary() -> None:
    logits = torch.zeros(2, 10)
    rows = [row(SamplingParams(presence_penalty=1.0), [1, 2, 10], 1), row(SamplingParams(), [3])]
    with pytest.raises(ValueError, match="outside"):
        Sampler("cpu", kernels=KERNEL)._penalise(logits, rows)


@pytest.mark.parametrize("vocab", [5, 16, 300, 49152])
def test_kernel_logprobs_equal_the_torch_paths(vocab: int) -> None:
    """The chosen token's logprob and the top logprobs (as many as the most any row asks for, each
    row given its own count), rows partly masked to -inf among them: torch's log-softmax and topk."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=generator) * 5
    logits[1, ::3] = float("-inf")
    num_top = min(vocab - 1, 20)
    params = [SamplingParams(temperature=0.9, logprobs=True, top_logprobs=min(i * 3, num_top)) for i in range(7)]
    params.append(SamplingParams(temperature=0.9))  # no logprobs asked for
    rows = [row(p) for p in params]
    samples = Sampler("cpu", seed=1, kernels=KERNEL).sample(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    for index, sample in enumerate(samples):
        assert reference[index, sample.token_id] > float("-inf")
        if not params[index].logprobs:
            assert sample.logprob is None and sample.top_logprobs is None
            continue
        assert_logprobs(sample, reference[index], params[index].top_logprobs)


def test_kernel_logprobs_leave_non_finite_rows_to_torch() -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    logits[1, 4] = float("nan")
    chosen, row_ids = torch.tensor([0, 1, 2]), torch.tensor([2, 1, 0])
    assert SAMPLING.logprobs(logits, row_ids, chosen, 3) is None
    logits[1, 4] = 0.0
    got = SAMPLING.logprobs(logits, row_ids, chosen, 3)
    assert got is not None and torch.allclose(got[0], torch.log_softmax(logits, -1)[[2, 1, 0], [0, 1, 2]], atol=1e-6)
    with pytest.raises(ValueError, match="num_top"):
        SAMPLING.logprobs(logits, row_ids, chosen, 65)
    with pytest.raises(IndexError, match="row numbers"):
        SAMPLING.logprobs(logits, torch.tensor([0, 1, 3]), chosen, 3)
    with_nan = torch.where(torch.arange(100) == 7, float("nan"), logits)
    rows = [row(SamplingParams(logprobs=True, top_logprobs=2))] * 3
    compiled = Sampler("cpu", seed=0, kernels=KERNEL).sample(with_nan, rows)
    plain = Sampler("cpu", seed=0).sample(with_nan, rows)  # the torch path's answer for such rows
    assert [s.token_id for s in compiled] == [s.token_id for s in plain]
    assert all(math.isnan(s.logprob) for s in compiled + plain)
    assert [[t for t, _ in s.top_logprobs] for s in compiled] == [[t for t, _ in s.top_logprobs] for s in plain]


@pytest.mark.parametrize(("vocab", "top_k"), [(1000, 10), (49152, 10_000)])
def test_kernel_breaks_ties_towards_lower_token_ids(vocab: int, top_k: int) -> None:
    """Equal logits: top_k keeps the lowest ids among the tied (the kernel's documented order; few
    candidates, then so many that the draw walks the whole row), and draws spread over all of them."""
    num_draws = 400
    logits = torch.zeros(num_draws, vocab)
    samples = Sampler("cpu", seed=2, kernels=KERNEL).sample(logits, [row(SamplingParams(temperature=1.0, top_k=top_k))]
                                                             * num_draws)
    drawn = [s.token_id for s in samples]
    assert max(drawn) < top_k
    assert len(set(drawn)) > min(top_k, num_draws) // 2


# ---- greedy rows ----------------------------------------------------------------------------------

@pytest.mark.parametrize("cols", [1, 15, 16, 17, 100, 49_152])
def test_argmax_rows_equal_torch_argmax_ties_and_infinities_included(cols, threads) -> None:
    """The first index of each row's maximum, as torch.argmax: random rows, rows whose maximum
    repeats (the first counts), -0.0 beside 0.0, +inf, and rows of -inf only."""
    generator = torch.Generator().manual_seed(cols)
    rows = torch.randn(40, cols + 3, generator=generator)[:, 1:cols + 1]  # rows apart by more than cols
    top = rows.max(dim=-1).values
    for r in range(0, 40, 5):  # repeat the maximum after its first place
        rows[r, torch.randint(0, cols, (3,), generator=generator)] = top[r]
    rows[1] = 0.0
    rows[1, cols // 2:] = -0.0
    rows[2] = float("-inf")
    rows[3, cols - 1] = float("inf")
    rows[4, : cols // 2 + 1] = float("inf")
    got = SAMPLING.argmax_rows(rows)
    assert got is not None and got.dtype == torch.int64
    assert torch.equal(got, rows.argmax(dim=-1))


def test_argmax_rows_leave_a_nan_to_torch_and_the_sampler_agrees() -> None:
    rows = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    rows[4, 7] = float("nan")
    assert SAMPLING.argmax_rows(rows) is None  # torch.argmax says where the NaN is
    sample_rows = [SampleRow(SamplingParams(temperature=0.0), [1], 1) for _ in range(6)]
    with_kernel = Sampler("cpu", seed=0, kernels=KERNEL).sample(rows, sample_rows)
    without = Sampler("cpu", seed=0).sample(rows, sample_rows)
    assert [s.token_id for s in with_kernel] == [s.token_id for s in without] == rows.argmax(dim=-1).tolist()
    rows[4, 7] = 0.0
    assert [s.token_id for s in Sampler("cpu", seed=0, kernels=KERNEL).sample(rows, sample_rows)] == \
        rows.argmax(dim=-1).tolist()
