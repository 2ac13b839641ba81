"""The sampler's behaviour: greedy, penalties, truncation, seeded reproducibility and logprobs, each
on both paths (PyTorch's ops and the compiled kernels, `new_sampler`); the kernels held to the
torch path row by row are in `test_sampling_kernels.py`."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import worker_service.sampling.torch_ops as sampling_torch
from radixserve.sampling import SamplingParams
from worker_service.sampling import Sampler
from worker_service.sampling.ops import CpuSampling, TorchSampling
from worker_service.sampling.torch_ops import apply_penalties, truncate

from worker.sampling_helpers import KERNEL, assert_logprobs, needs_kernel, row


# Probabilities of a crafted 6-token distribution; logits are their logs.
PROBS = [0.40, 0.25, 0.15, 0.10, 0.06, 0.04]
CRAFTED = torch.tensor([math.log(p) for p in PROBS])


@pytest.fixture(params=["torch", pytest.param("kernel", marks=needs_kernel)])
def new_sampler(request: pytest.FixtureRequest):
    """Makes samplers that draw in PyTorch's ops, or in the compiled kernel."""
    kernels = KERNEL if request.param == "kernel" else None
    return lambda seed=None: Sampler("cpu", seed=seed, kernels=kernels)


def test_greedy_is_argmax(new_sampler) -> None:
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(0))
    samples = new_sampler(seed=1).sample(logits, [row(SamplingParams())] * 8)
    assert [s.token_id for s in samples] == logits.argmax(dim=-1).tolist()
    assert all(s.logprob is None and s.top_logprobs is None for s in samples)


def test_numpy_argmax_answers_as_torch_on_ties_nan_and_infinities() -> None:
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1.0, nan, 3.0, nan], [2.0, 5.0, 5.0, 1.0], [-inf] * 4, [1.0, inf, inf, 0.0]])
    ops = TorchSampling()
    expected = ops.argmax(logits)
    assert CpuSampling().argmax(logits).tolist() == expected.tolist() == [1, 1, 0, 1]
    strided = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))[:, ::3]
    assert CpuSampling().argmax(strided).tolist() == ops.argmax(strided).tolist()
    assert CpuSampling().argmax(strided).dtype == torch.int64


def test_penalties_change_logits_exactly() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    # Prompt tokens 0 and 1; output tokens 2, 2, 3.
    out = apply_penalties(logits, [row(params, [0, 1, 2, 2, 3], num_prompt=2)])
    expected = [
        2.0 / 2,  # prompt token, positive: divided; presence/frequency ignore prompt tokens
        -1.0 * 2,  # prompt token, negative: multiplied
        0.5 / 2 - 0.5 - 0.25 * 2,  # output twice
        3.0 / 2 - 0.5 - 0.25 * 1,  # output once
        1.0,  # unseen
        -2.0,  # unseen
    ]
    assert out[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0, 1.0, -2.0], "input must not change"


def test_penalties_apply_per_row_only() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    rows = [row(SamplingParams(frequency_penalty=1.0), [0, 1, 1], num_prompt=1), row(SamplingParams(), [1, 1])]
    out = apply_penalties(logits, rows)
    assert out.tolist() == [[1.0, -1.0, 1.0], [1.0, 1.0, 1.0]]


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
        (SamplingParams(temperature=1.0, top_p=0.7), {0, 1, 2}),  # 0.40 + 0.25 < 0.7: needs token 2
        (SamplingParams(temperature=1.0, top_p=0.5), {0, 1}),
        (SamplingParams(temperature=1.0, min_p=0.3), {0, 1, 2}),  # p >= 0.12
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.6), {0, 1}),  # top_p on the top-3 mass
        # min_p acts after temperature: p^(1/0.7) of token 3 is below 0.2 * the top one.
        (SamplingParams(temperature=0.7, top_k=5, min_p=0.2), {0, 1, 2}),
    ],
)
def test_truncation_never_emits_excluded_tokens(params: SamplingParams, allowed: set[int], new_sampler) -> None:
    num_draws = 2000
    logits = CRAFTED.repeat(num_draws, 1)
    samples = new_sampler(seed=7).sample(logits, [row(params)] * num_draws)
    drawn = [s.token_id for s in samples]
    assert set(drawn) == allowed  # every allowed token shows up, nothing else does
    # The draw follows the renormalised distribution (5 sigma bounds for 2,000 draws).
    scaled = [p ** (1 / params.temperature) for p in PROBS]
    mass = sum(scaled[i] for i in allowed)
    for token in allowed:
        expected = scaled[token] / mass
        sigma = math.sqrt(expected * (1 - expected) / num_draws)
        assert abs(drawn.count(token) / num_draws - expected) < 5 * sigma + 1e-3


def reference_keep(probs: list[float], params: SamplingParams) -> set[int]:
    """top_k, then top_p on the renormalised rest, then min_p: one row, the slow obvious way."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if params.top_k:
        order = order[: params.top_k]
    total = sum(probs[i] for i in order)
    kept, mass = [], 0.0
    for i in order:
        if kept and mass >= params.top_p:
            break
        kept.append(i)
        mass += probs[i] / total
    best = max(probs)
    return {i for i in kept if probs[i] >= params.min_p * best}


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    vocab=st.integers(2, 40),
    top_k=st.integers(0, 40),
    top_p=st.floats(0.05, 1.0),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
)
def test_truncate_matches_a_plain_reference(seed: int, vocab: int, top_k: int, top_p: float, min_p: float) -> None:
    # Distinct, well-separated probabilities so that float rounding cannot decide a boundary.
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randperm(vocab, generator=generator).double() * 0.37
    probs = torch.softmax(logits, dim=-1).unsqueeze(0)
    params = SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p)
    ranked = sorted(probs[0].tolist(), reverse=True)[: top_k or vocab]
    boundaries = [sum(ranked[: i + 1]) / sum(ranked) for i in range(len(ranked) - 1)]
    if any(abs(b - top_p) < 1e-9 for b in boundaries):
        return  # top_p sits on a boundary: rounding, not the code, would decide
    # Narrow ranking widths so that the topk -> wider -> full-sort passes all get exercised.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampling_torch, "CANDIDATE_WIDTHS", (2, 5))
        kept = truncate(probs, [row(params)])
    assert {i for i, p in enumerate(kept[0].tolist()) if p > 0} == reference_keep(probs[0].tolist(), params)
    assert float(kept.sum()) == pytest.approx(1.0)


def test_top_p_over_a_flat_distribution_needs_the_full_ranking() -> None:
    probs = torch.softmax(torch.linspace(0, 1, 5000), dim=-1).unsqueeze(0)
    kept = truncate(probs, [row(SamplingParams(top_p=0.9))])
    expected = reference_keep(probs[0].tolist(), SamplingParams(top_p=0.9))
    assert len(expected) > 4096
    assert {i for i, p in enumerate(kept[0].tolist()) if p > 0} == expected


def test_truncate_keeps_the_top_token_even_with_tiny_top_p() -> None:
    probs = torch.softmax(CRAFTED, dim=-1).unsqueeze(0)
    kept = truncate(probs, [row(SamplingParams(top_p=1e-6, min_p=1.0, top_k=1))])
    assert kept[0].tolist() == [1.0, 0, 0, 0, 0, 0]


# The fixture only picks a sampler kind; nothing in it carries over between examples.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 1.0),
    temperature=st.floats(0.1, 3.0),
)
def test_drawn_token_always_survives_truncation(
    seed: int, top_k: int, top_p: float, min_p: float, temperature: float, new_sampler
) -> None:
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(seed)) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    rows = [row(params)] * 4
    kept = truncate(torch.softmax(logits / temperature, dim=-1), rows)
    for index, sample in enumerate(new_sampler(seed=seed).sample(logits, rows)):
        assert kept[index, sample.token_id] > 0
        if top_k:
            assert int((kept[index] > 0).sum()) <= top_k


def test_seeded_rows_reproduce_alone_or_batched(new_sampler) -> None:
    vocab = 1000
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=1.0, seed=1234)
    history = [5, 6, 7, 8]  # 2 prompt + 2 output tokens
    alone = new_sampler().sample(logits[:1], [row(seeded, history, num_prompt=2)])[0].token_id
    others = [row(SamplingParams(temperature=1.5)), row(SamplingParams(temperature=0.8, seed=99))]
    for position in range(3):
        batch_rows = list(others)
        batch_rows.insert(position, row(seeded, history, num_prompt=2))
        batch_logits = torch.cat([logits[1:3], logits[1:3]])[: len(batch_rows)].clone()
        batch_logits[position] = logits[0]
        samples = new_sampler().sample(batch_logits, batch_rows)  # a fresh shared generator each time
        assert samples[position].token_id == alone


def test_seeded_draw_depends_on_seed_and_step(new_sampler) -> None:
    logits = torch.zeros(1, 5000)  # uniform: the token is the noise's choice alone
    sampler = new_sampler()

    def draw(seed: int, num_outputs: int) -> int:
        params = SamplingParams(temperature=1.0, seed=seed)
        return sampler.sample(logits, [row(params, [1] * (3 + num_outputs), num_prompt=3)])[0].token_id

    steps = [draw(42, n) for n in range(8)]
    assert steps == [draw(42, n) for n in range(8)]
    assert len(set(steps)) > 1, "each step must draw fresh noise"
    assert [draw(43, n) for n in range(8)] != steps


def test_unseeded_rows_vary_and_shared_seed_reproduces(new_sampler) -> None:
    logits = torch.zeros(64, 5000)
    rows = [row(SamplingParams(temperature=1.0))] * 64
    first = [s.token_id for s in new_sampler(seed=5).sample(logits, rows)]
    assert len(set(first)) > 32
    assert first == [s.token_id for s in new_sampler(seed=5).sample(logits, rows)]


def test_logprobs_are_log_softmax_of_raw_logits(new_sampler) -> None:
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(11)) * 4
    params = [
        SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.3, logprobs=True, top_logprobs=5, seed=1),
        SamplingParams(logprobs=True),
        SamplingParams(temperature=2.0, top_logprobs=20, presence_penalty=1.0),
    ]
    rows = [row(params[0], [1, 2, 3], 1), row(params[1]), row(params[2], [4, 4], 1)]
    samples = new_sampler(seed=0).sample(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    for index, sample in enumerate(samples):
        assert_logprobs(sample, reference[index], params[index].top_logprobs)


def test_top_logprobs_hold_only_the_tokens_a_mask_allows(new_sampler) -> None:
    """A constrained row's logits arrive masked (-inf where the grammar forbids): its top
    logprobs list the allowed tokens only, fewer than asked where fewer are allowed (a -inf would
    make the HTTP answer invalid JSON)."""
    logits = torch.full((2, 50), float("-inf"))
    logits[0, [7, 9]] = torch.tensor([1.0, 2.0])
    logits[1, 3] = 0.5  # one forced token
    params = SamplingParams(temperature=1.0, logprobs=True, top_logprobs=5, seed=3)
    samples = new_sampler(seed=0).sample(logits, [row(params), row(params)])
    assert [token for token, _ in samples[0].top_logprobs] == [9, 7]
    assert samples[0].top_logprobs[0][1] == pytest.approx(math.log(math.e / (math.e + 1)), abs=1e-5)
    assert samples[1].token_id == 3 and samples[1].logprob == 0.0 and samples[1].top_logprobs == [(3, 0.0)]


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(presence_penalty=float("nan")), "presence_penalty"),
        (SamplingParams(top_logprobs=21), "top_logprobs"),
        (SamplingParams(logit_bias=((5, 100.5),)), "logit_bias[5]"),
        (SamplingParams(logit_bias=((-1, 1.0),)), "token id -1"),
    ],
)
def test_bad_sampling_values_are_named(params: SamplingParams, needle: str) -> None:
    problems = params.problems()
    assert len(problems) == 1 and needle in problems[0]
    assert SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, seed=2**64 - 1).problems() == []


def test_logit_bias_moves_the_draw_and_leaves_logprobs_raw(new_sampler) -> None:
    """A bias of 100 makes greedy and sampled rows pick a token they never would; -100 bans the
    argmax; logprobs stay those of the raw logits (the documented order)."""
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(4)) * 3
    least = logits[0].argmin().item()
    top = logits[1].argmax().item()
    params = [
        SamplingParams(logit_bias=((least, 100.0),), logprobs=True),
        SamplingParams(logit_bias=((top, -100.0),)),
        SamplingParams(temperature=1.0, top_k=1, logit_bias=((7, 100.0), (least, 100.0)), seed=3),
    ]
    samples = new_sampler(seed=0).sample(logits, [row(p) for p in params])
    assert samples[0].token_id == least
    assert samples[1].token_id != top
    assert samples[1].token_id == logits[1].topk(2).indices[1].item()
    expected = 7 if logits[2, 7] > logits[2, least] else least
    assert samples[2].token_id == expected
    assert samples[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[least].item(), abs=1e-5)
    assert logits.equal(torch.randn(3, 300, generator=torch.Generator().manual_seed(4)) * 3), "input must not change"
