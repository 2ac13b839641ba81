"""Quantized weights: one value type for every format the worker multiplies with, and the
load-time quantizers that make it from a plain weight.

Two layouts cover our formats and the GGUF types (every one maps exactly onto one of them):
- `int8`: signed 8-bit values `[N, K]`, a float scale per group of `group_size` columns (the
  whole row for `--quantization int8`, per output channel, symmetric; 32 for GGUF Q8_0; 16 for
  Q6_K, whose 6-bit values minus 32 fit int8): w = value * scale.
- `int4`: unsigned 4-bit values two per byte, a float scale and offset per group of `group_size`
  columns (a multiple of 32): w = value * scale + offset (Q4_0's `d * (q - 8)` is offset -8d,
  Q4_1's min is the offset, Q4_K's sub-block scales and mins times d and dmin are per-32 ones).
  Byte `16 b + i` holds column `32 b + i` in its low nibble and `32 b + 16 + i` in its high one,
  so a 32-column block unpacks with one mask and one shift; the last block is padded with zeros.

Groups run along K (a row's input features), so a tensor-parallel shard of whole rows, or of
columns on group boundaries, is a quantized weight of the same format (`rows`, `cols`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("int8", "int4")
INT4_BLOCK = 32  # columns per packed block (and the smallest int4 group)


@dataclass(slots=True, frozen=True)
class QuantizedWeight:
    """A `[out_features, in_features]` weight in `format` (module doc). `scales` (and `offsets`,
    int4 only) are float32 `[out_features, num_groups]`; `values` int8 `[N, K]` or uint8
    `[N, ceil(K / 32) * 16]`."""

    format: str
    values: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group_size: int
    in_features: int

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown quantized format {self.format!r}")
        if self.format == "int4" and (self.offsets is None or self.group_size % INT4_BLOCK):
            raise ValueError(f"int4 needs offsets and groups of a multiple of {INT4_BLOCK} columns")
        if self.scales.shape != (self.out_features, num_groups(self.in_features, self.group_size)):
            raise ValueError(f"scales {tuple(self.scales.shape)} do not match {self.out_features} rows "
                             f"of {self.in_features} columns in groups of {self.group_size}")

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        """The bytes a product reads: values, scales and offsets."""
        extra = 0 if self.offsets is None else self.offsets.nbytes
        return self.values.nbytes + self.scales.nbytes + extra

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The plain `[N, K]` weight these values stand for (computed in float32, then `dtype`)."""
        if self.format == "int8":
            values = self.values.float()
        else:
            values = unpack_int4(self.values)[:, : self.in_features].float()
        scales = self.scales.repeat_interleave(self.group_size, dim=1)[:, : self.in_features]
        weight = values * scales
        if self.offsets is not None:
            weight += self.offsets.repeat_interleave(self.group_size, dim=1)[:, : self.in_features]
        return weight.to(dtype)

    def to(self, device: torch.device) -> QuantizedWeight:
        """The same weight with its tensors on `device` (itself where they are there already)."""
        if self.values.device == device:
            return self
        return QuantizedWeight(self.format, self.values.to(device), self.scales.to(device),
                               None if self.offsets is None else self.offsets.to(device),
                               self.group_size, self.in_features)

    def rows(self, selection: range) -> QuantizedWeight:
        """Output rows `selection` (a column-parallel shard)."""
        part = slice(selection.start, selection.stop)
        return QuantizedWeight(self.format, self.values[part].contiguous(), self.scales[part].contiguous(),
                               None if self.offsets is None else self.offsets[part].contiguous(),
                               self.group_size, self.in_features)

    def take_rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Output rows in the order `index` gives (a permutation of them: every row is whole)."""
        index = index.to(self.values.device)
        return QuantizedWeight(self.format, self.values.index_select(0, index), self.scales.index_select(0, index),
                               None if self.offsets is None else self.offsets.index_select(0, index),
                               self.group_size, self.in_features)

    def cols(self, selection: range) -> QuantizedWeight:
        """Input columns `selection` (a row-parallel shard): it must start on a group boundary and
        end on one or at the last column, so that every group stays whole."""
        start, stop = selection.start, selection.stop
        if start % self.group_size or (stop % self.group_size and stop != self.in_features):
            raise ValueError(f"columns {start}..{stop} cut groups of {self.group_size}")
        groups = slice(start // self.group_size, num_groups(stop, self.group_size))
        if self.format == "int8":
            values = self.values[:, start:stop]
        else:
            values = self.values[:, start // 2: num_groups(stop, INT4_BLOCK) * INT4_BLOCK // 2]
        return QuantizedWeight(self.format, values.contiguous(), self.scales[:, groups].contiguous(),
                               None if self.offsets is None else self.offsets[:, groups].contiguous(),
                               self.group_size, stop - start)


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight | None:
    """`weights` stacked along their rows (merged q, k and v), or None where their layouts
    differ (format, group size or columns): those stay separate products."""
    first = weights[0]
    if any((w.format, w.group_size, w.in_features) != (first.format, first.group_size, first.in_features)
           for w in weights):
        return None
    offsets = None if first.offsets is None else torch.cat([w.offsets for w in weights])
    return QuantizedWeight(first.format, torch.cat([w.values for w in weights]),
                           torch.cat([w.scales for w in weights]), offsets, first.group_size, first.in_features)


def merge_row_blocks(weights: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """Consecutive row blocks merged wherever they share a layout (q, k and v of one layout: one)."""
    merged = [weights[0]]
    for weight in weights[1:]:
        joined = concat_rows([merged[-1], weight])
        merged[-1:] = [joined] if joined is not None else [merged[-1], weight]
    return merged


def num_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def _grouped(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """`weight` `[N, K]` in float32 as `[N, G, group_size]`, the last group padded with its own
    first column (so padding never widens a group's range)."""
    n, k = weight.shape
    padded = num_groups(k, group_size) * group_size
    weight = weight.float()
    if padded != k:
        last = weight[:, (k // group_size) * group_size: (k // group_size) * group_size + 1]
        weight = torch.cat([weight, last.expand(n, padded - k)], dim=1)
    return weight.view(n, -1, group_size)


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8 with one scale per `group_size` columns (None: per output channel)."""
    n, k = weight.shape
    group_size = group_size or k
    groups = _grouped(weight, group_size)
    scales = groups.abs().amax(dim=2) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(groups / safe.unsqueeze(2)).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", values.view(n, -1)[:, :k].contiguous(), scales, None, group_size, k)


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Unsigned int4 with a scale and offset (the group's minimum) per `group_size` columns."""
    n, k = weight.shape
    groups = _grouped(weight, group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scales = (high - low) / 15.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round((groups - low.unsqueeze(2)) / safe.unsqueeze(2)).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight("int4", pack_int4(values.view(n, -1)[:, :k]), scales, low, group_size, k)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 `[N, K]` -> the packed layout `[N, ceil(K / 32) * 16]` (module doc)."""
    n, k = values.shape
    padded = num_groups(k, INT4_BLOCK) * INT4_BLOCK
    if padded != k:
        values = torch.cat([values, values.new_zeros(n, padded - k)], dim=1)
    blocks = values.view(n, -1, 2, INT4_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, -1).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The packed layout -> uint8 values `[N, padded K]` (the inverse of `pack_int4`)."""
    n = packed.shape[0]
    blocks = packed.view(n, -1, INT4_BLOCK // 2)
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=2).reshape(n, -1)
