"""The CUDA suite: skipped where no CUDA device is visible (every CI machine of this project).

It runs on a lent GPU machine as `python -m pytest tests/gpu` after `tests/gpu/random_checkpoint.py`
has made the default model's folder there: the weights cannot travel to such a machine (its
transfers are limited to 64 MiB), so it holds SmolLM2-135M's shape, config and tokenizer with
random weights. Every comparison is with transformers on the same weights, so random ones test
the same code; see `random_checkpoint.py` for why their scale is not transformers' default.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items) -> None:
    """Skip this folder's tests without CUDA; the Triton kernel's tests may run in Triton's CPU
    interpreter instead (TRITON_INTERPRET=1), which they check themselves."""
    if CUDA:
        return
    interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.path) and not (interpreter and "triton" in item.path.name):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _free_cuda_memory():
    """Each test starts from the memory the last one left, not what its runners cached."""
    yield
    if CUDA:
        torch.cuda.empty_cache()
