"""The worker's backends as test parameters: every `--attention-kernel` backend, each one that the
selection function (`worker_service.backends.select_backend`) refuses on this machine skipped with
its reason. Parity tests run on each; a runner built with a choice is checked to run that backend."""

from __future__ import annotations

import pytest
import torch

from worker_service.backends import select_backend

BACKEND_NAMES = ("torch", "native", "triton")


def backend_params(device: str = "cpu", dtype: torch.dtype = torch.float32, head_dim: int = 16) -> list:
    """`pytest.param`s of the backend names for a model of `head_dim` in `dtype` on `device`."""
    params = []
    for name in BACKEND_NAMES:
        try:
            select_backend(name, device, dtype, head_dim)
        except RuntimeError as refusal:
            params.append(pytest.param(name, marks=pytest.mark.skip(reason=str(refusal))))
        else:
            params.append(pytest.param(name))
    return params
