"""Additive attention masks, made once per step in the dtype their kernel adds them in (the model
dtype for prefill's SDPA, float32 for decode's scores).

A float mask is taken as is; a boolean one would be converted in every layer of every step.
"""

from __future__ import annotations

import torch


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `allowed`, -inf elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf"))
