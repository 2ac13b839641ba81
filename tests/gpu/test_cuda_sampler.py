"""The sampler on CUDA logits (the torch path: the compiled kernels are CPU-only): the same tokens
as on CPU for the same random numbers, seeded rows reproducible, logprobs of the raw logits."""

from __future__ import annotations

import itertools

import pytest
import torch

from radixserve.sampling import SamplingParams
from worker.sampling_helpers import assert_logprobs, row
from worker_service.sampling import Sampler
from worker_service.sampling.ops import TorchSampling

DEVICE = "cuda"
VOCAB = 49152
NUM_ROWS = 24


def logits_rows(seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(NUM_ROWS, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


PARAMS = [
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=50),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.8, top_k=200, top_p=0.5, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(temperature=0.0, repetition_penalty=1.5),
]


@pytest.mark.parametrize(("params", "seed"), list(itertools.product(PARAMS, range(2))))
def test_cuda_draws_the_cpu_torch_paths_tokens_for_the_same_random_numbers(params, seed) -> None:
    history = torch.randint(0, VOCAB, (NUM_ROWS, 300), generator=torch.Generator().manual_seed(seed)).tolist()
    rows = [row(params, ids, num_prompt=200) for ids in history]
    logits = logits_rows(seed)
    uniform = torch.rand(NUM_ROWS, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 7))
    is_random = [params.temperature > 0] * NUM_ROWS
    chosen = []
    for device in ("cpu", DEVICE):
        sampler = Sampler(device, seed=0)
        penalised = sampler._penalise(logits.to(device), rows)
        ops = TorchSampling()  # the PyTorch ops the sampler runs on either device without the CPU kernels
        if params.temperature > 0:
            chosen.append(ops.sample(penalised, rows, is_random, uniform.to(device)).tolist())
        else:
            chosen.append(ops.argmax(penalised).tolist())
    assert chosen[0] == chosen[1]


def test_seeded_rows_repeat_and_unseeded_rows_vary() -> None:
    logits = logits_rows(0, scale=0.5).to(DEVICE)
    seeded = [row(SamplingParams(temperature=1.0, seed=1234 + i)) for i in range(NUM_ROWS)]
    first = [s.token_id for s in Sampler(DEVICE).sample(logits, seeded)]
    second = [s.token_id for s in Sampler(DEVICE).sample(logits, seeded)]
    assert first == second
    unseeded = [row(SamplingParams(temperature=1.0)) for _ in range(NUM_ROWS)]
    sampler = Sampler(DEVICE)
    draws = {tuple(s.token_id for s in sampler.sample(logits, unseeded)) for _ in range(3)}
    assert len(draws) == 3


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_are_the_raw_logits_log_softmax(temperature: float) -> None:
    logits = logits_rows(5)
    rows = [row(SamplingParams(temperature=temperature, logprobs=True, top_logprobs=3, repetition_penalty=1.2),
                [1, 2, 3]) for _ in range(NUM_ROWS)]
    samples = Sampler(DEVICE, seed=3).sample(logits.to(DEVICE), rows)
    reference = torch.log_softmax(logits.double(), dim=-1).float()
    for sample, expected in zip(samples, reference):
        assert_logprobs(sample, expected, 3)


def test_greedy_rows_take_the_argmax() -> None:
    logits = logits_rows(9).to(DEVICE)
    samples = Sampler(DEVICE).sample(logits, [row(SamplingParams(temperature=0.0))] * NUM_ROWS)
    assert [s.token_id for s in samples] == logits.argmax(-1).tolist()
