"""`--quantization`: which weights a worker quantizes at load time, and how.

`int8` is symmetric per output channel, `int4` group-wise with a scale and offset per group
(`format.py`). Only the decoder layers' linear weights are quantized; the embedding and the LM
head stay in the model's dtype: the embedding is a lookup (one row per token, its bytes do not
bound a decode step), and the LM head's logits feed sampling directly, where rounding is seen
first (docs/quantization.md). Each rank quantizes its own shard after reading it, so groups
never straddle ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.shared_flags import QUANTIZATION_NAMES

from worker_service.quant.format import QuantizedWeight, quantize_int4, quantize_int8

QUANTIZATION_CHOICES = QUANTIZATION_NAMES
GROUP_SIZE_CHOICES = (32, 64)

Quantizer = Callable[[torch.Tensor], QuantizedWeight]


def served_name(quantization: str, group_size: int) -> str:
    """How a worker reports `quantization` (GetWorkerInfo, metrics): int4 with its group size."""
    return f"int4-g{group_size}" if quantization == "int4" else quantization


def quantizer(quantization: str, group_size: int = 32) -> Quantizer | None:
    """What turns a loaded linear weight into its quantized form (None for `none`)."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown quantization {quantization!r}; choose from {', '.join(QUANTIZATION_CHOICES)}")
    if group_size not in GROUP_SIZE_CHOICES:
        raise ValueError(f"int4 groups are {' or '.join(map(str, GROUP_SIZE_CHOICES))} columns, not {group_size}")
    if quantization == "int8":
        return quantize_int8
    if quantization == "int4":
        return lambda weight: quantize_int4(weight, group_size)
    return None
