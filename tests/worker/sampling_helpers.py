"""What the sampler's tests share: the compiled kernels (where they build), a row of sampler input,
and the logprobs check."""

from __future__ import annotations

import pytest
import torch

from radixserve.sampling import SamplingParams
from worker_service import native
from worker_service.sampling import Sample, SampleRow
from worker_service.sampling.kernels import SamplingKernels

KERNEL = native.load()
# The sampling kernels' own bindings, for tests that call them without the sampler.
SAMPLING = SamplingKernels(KERNEL.lib) if KERNEL is not None else None
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"the kernels do not build here: {native.failure()}")


def row(params: SamplingParams, token_ids: list[int] | None = None, num_prompt: int = 0) -> SampleRow:
    return SampleRow(params=params, token_ids=token_ids or [], num_prompt_tokens=num_prompt)


def assert_logprobs(sample: Sample, reference: torch.Tensor, wanted: int) -> None:
    """`sample`'s logprob and `wanted` top logprobs are those of the log-softmax row `reference`."""
    assert sample.logprob == pytest.approx(reference[sample.token_id].item(), abs=1e-5)
    if wanted:
        values, ids = reference.topk(wanted)
        assert [t for t, _ in sample.top_logprobs] == ids.tolist()
        assert [v for _, v in sample.top_logprobs] == pytest.approx(values.tolist(), abs=1e-5)
    else:
        assert sample.top_logprobs is None
