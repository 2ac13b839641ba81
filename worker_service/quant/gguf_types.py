"""GGUF quantization types kept as they are: each block type mapped exactly onto one of our
layouts (`format.py`), from the raw rows the `gguf` package reads (`GGUFReader` tensors' `data`,
`[rows, bytes per row]` uint8).

| GGUF | ours | how |
|---|---|---|
| Q8_0 | int8, groups of 32 | values as they are, scale d |
| Q4_0 | int4, groups of 32 | nibbles as they are (the same layout), scale d, offset -8 d |
| Q4_1 | int4, groups of 32 | nibbles as they are, scale d, offset m |
| Q4_K | int4, groups of 32 | nibbles re-laid, scale d * sc, offset -dmin * m per sub-block |
| Q6_K | int8, groups of 16 | the 6-bit value minus 32, scale d * sc per sub-block |

Each product of a half-precision number and a 6- or 8-bit integer is exact in float32, so the
weights these stand for are exactly the ones `gguf.quants.dequantize` computes. Other types are
not kept (`KEPT_TYPES`): the loader dequantizes them with the `gguf` package.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K

from worker_service.quant.format import QuantizedWeight, pack_int4

SUPER_BLOCK = 256  # columns per K-quant super-block


def _split(rows: np.ndarray, block_bytes: int, *widths: int) -> list[np.ndarray]:
    """`rows` `[N, nb * block_bytes]` as `[N, nb, block_bytes]`, cut into fields of `widths` bytes."""
    blocks = np.ascontiguousarray(rows).reshape(rows.shape[0], -1, block_bytes)
    cuts = np.cumsum(widths)[:-1]
    return np.split(blocks, cuts, axis=2)


def _half(field: np.ndarray) -> torch.Tensor:
    """A 2-byte field `[N, nb, 2]` as float32 `[N, nb]`."""
    return torch.from_numpy(np.ascontiguousarray(field).view(np.float16)[..., 0].astype(np.float32))


def _q8_0(rows: np.ndarray, k: int) -> QuantizedWeight:
    d, qs = _split(rows, 34, 2, 32)
    values = torch.from_numpy(np.ascontiguousarray(qs).view(np.int8).reshape(rows.shape[0], k))
    return QuantizedWeight("int8", values, _half(d), None, 32, k)


def _q4_0(rows: np.ndarray, k: int) -> QuantizedWeight:
    d, qs = _split(rows, 18, 2, 16)
    scales = _half(d)
    values = torch.from_numpy(np.ascontiguousarray(qs).reshape(rows.shape[0], -1))
    return QuantizedWeight("int4", values, scales, -8.0 * scales, 32, k)


def _q4_1(rows: np.ndarray, k: int) -> QuantizedWeight:
    d, m, qs = _split(rows, 20, 2, 2, 16)
    values = torch.from_numpy(np.ascontiguousarray(qs).reshape(rows.shape[0], -1))
    return QuantizedWeight("int4", values, _half(d), _half(m), 32, k)


def _q4_k(rows: np.ndarray, k: int) -> QuantizedWeight:
    n = rows.shape[0]
    d, dmin, packed_scales, qs = _split(rows, 144, 2, 2, 12, 128)
    sc, mins = Q4_K.get_scale_min(np.ascontiguousarray(packed_scales).reshape(-1, 12))
    sub = (n, -1)  # one entry per 32-column sub-block
    scales = _half(d).unsqueeze(2) * torch.from_numpy(sc.astype(np.float32)).view(n, -1, 8)
    offsets = -_half(dmin).unsqueeze(2) * torch.from_numpy(mins.astype(np.float32)).view(n, -1, 8)
    # Each 32-byte run holds two sub-blocks: the first in its low nibbles, the next in its high ones.
    runs = torch.from_numpy(np.ascontiguousarray(qs)).view(n, -1, 4, 32)
    values = torch.stack([runs & 0x0F, runs >> 4], dim=3).reshape(n, k)
    return QuantizedWeight("int4", pack_int4(values), scales.reshape(sub), offsets.reshape(sub), 32, k)


def _q6_k(rows: np.ndarray, k: int) -> QuantizedWeight:
    n = rows.shape[0]
    ql, qh, sc, d = _split(rows, 210, 128, 64, 16, 2)
    low = torch.from_numpy(np.ascontiguousarray(ql)).view(n, -1, 2, 64)   # two 128-column halves
    high = torch.from_numpy(np.ascontiguousarray(qh)).view(n, -1, 2, 32)
    # Within a 128-column half, column 32 j + i takes nibble j // 2 of low byte 32 (j % 2) + i
    # and bits 2 j.. of high byte i.
    low_nibbles = torch.stack([low[..., :32] & 0x0F, low[..., 32:] & 0x0F, low[..., :32] >> 4,
                               low[..., 32:] >> 4], dim=3)
    high_bits = torch.stack([(high >> shift) & 0x03 for shift in (0, 2, 4, 6)], dim=3)
    values = ((low_nibbles | (high_bits << 4)).to(torch.int16) - 32).to(torch.int8).reshape(n, k)
    sub_scales = torch.from_numpy(np.ascontiguousarray(sc).view(np.int8).astype(np.float32))
    scales = (_half(d).unsqueeze(2) * sub_scales).reshape(n, -1)
    return QuantizedWeight("int8", values, scales, None, 16, k)


CONVERTERS: dict[T, Callable[[np.ndarray, int], QuantizedWeight]] = {
    T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k, T.Q6_K: _q6_k,
}
KEPT_TYPES = tuple(CONVERTERS)


def to_quantized(rows: np.ndarray, qtype: T, in_features: int) -> QuantizedWeight:
    """The raw rows of a `qtype` tensor of `in_features` columns as our `QuantizedWeight`
    (`qtype` one of `KEPT_TYPES`; its rows hold whole blocks, as every GGUF row does)."""
    return CONVERTERS[qtype](rows, in_features)
