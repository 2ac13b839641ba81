"""Rank 0's sampling: the sampler (`sampler.py`), its steps in PyTorch's ops (`torch_ops.py`) and in
the compiled kernels (`kernels.py`), chosen once (`ops.py`)."""

from worker_service.sampling.rows import Sample, SampleRow
from worker_service.sampling.sampler import Sampler, seed_for_step

__all__ = ["Sample", "SampleRow", "Sampler", "seed_for_step"]
