"""Pre-quantized Hugging Face checkpoints (GPTQ and AWQ, 4 bits): what `quantization_config`
asks for, and each layer's packed tensors as our `int4` `QuantizedWeight`. An MXFP4 checkpoint
(`quant_method: mxfp4`, GPT-OSS's) is recognised here too; its layers are `quant/mxfp4.py`'s.

Both formats store, per linear layer, 4-bit values `q`, a 4-bit zero point `z` and a half-precision
scale `s` per group of `group_size` input columns, and stand for w = s * (q - z). That is our int4
layout's w = value * scale + offset with offset = -z * s (each product of a half-precision scale
and an integer below 17 is exact in float32, so the weights are exactly the format's). Packing,
eight 4-bit values per int32, lowest nibble first:

- GPTQ (`quant_method: gptq`): `qweight` `[K / 8, N]` packs along the input dimension (nibble j
  of row r is input column 8 r + j); `qzeros` `[K / group, N / 8]` packs along the output
  dimension; `scales` `[K / group, N]`; `g_idx` `[K]` names each input column's group. The classic
  checkpoint format (`checkpoint_format: gptq`, the default) stores each zero minus one (read
  back as the nibble plus one, so 1..16); `gptq_v2` stores it as it is. `sym` checkpoints hold 8
  (stored 7) everywhere; both read the same way. Only checkpoints without act-order (`desc_act:
  false`, `g_idx[k] == k // group_size`) map onto contiguous groups; others are refused.
- AWQ (`quant_method: awq`, `version: gemm`): `qweight` `[K, N / 8]` and `qzeros`
  `[K / group, N / 8]` both pack along the output dimension in the interleaved order
  `AWQ_ORDER` (nibble i of word c holds output column 8 c + AWQ_ORDER[i]); `scales`
  `[K / group, N]`; zeros as they are (`zero_point: true`).

Groups must be a multiple of 32 input columns (32, 64, 128), as the int4 products take them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker_service.quant import mxfp4
from worker_service.quant.format import INT4_BLOCK, QuantizedWeight, pack_int4
from worker_service.unsupported import UnsupportedModel

METHODS = ("gptq", "awq")
MXFP4 = "mxfp4"  # GPT-OSS's experts (`quant/mxfp4.py`)
BITS = 4
PACKED = 32 // BITS  # values per int32
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_VERSIONS = ("gemm",)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(slots=True, frozen=True)
class PrequantizedScheme:
    """A checkpoint's `quantization_config`, checked: `method` in `METHODS`, 4 bits, `group_size`
    a multiple of 32; `zeros_minus_one` for GPTQ's classic checkpoint format."""

    method: str
    group_size: int
    zeros_minus_one: bool = False

    @property
    def served_name(self) -> str:
        """How a worker reports it (GetWorkerInfo, /v1/models, metrics), e.g. `gptq:int4-g128`;
        MXFP4 is held as int8 values (`quant/mxfp4.py`): `mxfp4:int8-g32`."""
        held = "int8" if self.method == MXFP4 else "int4"
        return f"{self.method}:{held}-g{self.group_size}"


def _field(config: dict, *names: str, default: Any = None) -> Any:
    return next((config[name] for name in names if name in config), default)


def prequantized_scheme(hf_config: Any) -> PrequantizedScheme | None:
    """The scheme of a checkpoint quantized before it was saved, None for a plain one. Raises
    `UnsupportedModel` naming what is not supported (another method, bits, group size, GPTQ's
    act-order, AWQ's other kernels' layouts)."""
    config = getattr(hf_config, "quantization_config", None)
    if not config:
        return None
    if not isinstance(config, dict):
        config = config.to_dict()
    method = str(config.get("quant_method", "?")).lower()
    if method == MXFP4:  # its layout is fixed: E2M1 codes, one scale per 32 columns (`quant/mxfp4.py`)
        return PrequantizedScheme(MXFP4, mxfp4.GROUP)
    if method not in METHODS:
        raise UnsupportedModel(f"pre-quantized checkpoints ({method}) are not supported (only "
                               f"{' and '.join(METHODS)} int4, and mxfp4): serve the unquantized checkpoint "
                               "with --quantization int8|int4, or a GGUF file")
    bits = _field(config, "bits", "w_bit")
    if bits != BITS:
        raise UnsupportedModel(f"{method} checkpoints of {bits} bits are not supported (only {BITS})")
    group_size = _field(config, "group_size", "q_group_size")
    if not isinstance(group_size, int) or group_size <= 0 or group_size % INT4_BLOCK:
        raise UnsupportedModel(f"{method} group_size {group_size} is not supported: the int4 products take "
                               f"groups of a multiple of {INT4_BLOCK} input columns (32, 64, 128)")
    if method == "gptq":
        if config.get("desc_act"):
            raise UnsupportedModel("gptq checkpoints with act-order (desc_act: true) are not supported: their "
                                   "groups are not contiguous input columns")
        checkpoint_format = config.get("checkpoint_format", "gptq")
        if checkpoint_format not in GPTQ_FORMATS:
            raise UnsupportedModel(f"gptq checkpoint_format {checkpoint_format!r} is not supported "
                                   f"(only {', '.join(GPTQ_FORMATS)})")
        return PrequantizedScheme(method, group_size, zeros_minus_one=checkpoint_format == "gptq")
    version = str(config.get("version", "gemm")).lower()
    if version not in AWQ_VERSIONS:
        raise UnsupportedModel(f"awq version {version!r} is not supported (only {', '.join(AWQ_VERSIONS)})")
    if not config.get("zero_point", True):
        raise UnsupportedModel("awq checkpoints without zero points (zero_point: false) are not supported")
    return PrequantizedScheme(method, group_size)


def _unpack(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit values (lowest nibble first) along `dim`, as int32."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32)
    words = packed.to(torch.int32).unsqueeze(-1)
    nibbles = (words >> shifts) & 0xF  # [..., 8]
    if dim == 0:
        return nibbles.permute(0, 2, 1).reshape(-1, packed.shape[1])
    return nibbles.reshape(packed.shape[0], -1)


def _to_int4(values: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> QuantizedWeight:
    """`values` `[N, K]` (0..15), `zeros` and `scales` `[N, groups]` -> our int4 weight."""
    n, k = values.shape
    if k % group_size:
        raise UnsupportedModel(f"{k} input columns are not whole groups of {group_size}")
    scales = scales.float().contiguous()
    offsets = (-zeros.float() * scales).contiguous()
    return QuantizedWeight("int4", pack_int4(values.to(torch.uint8)), scales, offsets, group_size, k)


def gptq_weight(scheme: PrequantizedScheme, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None) -> QuantizedWeight:
    """One GPTQ layer's tensors (module doc) as our int4 weight. `g_idx` other than the
    act-order-free `k // group_size` is refused."""
    values = _unpack(qweight, dim=0)  # [K, N]
    k = values.shape[0]
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // scheme.group_size):
        raise UnsupportedModel("gptq g_idx is not k // group_size (an act-order checkpoint): not supported")
    zeros = _unpack(qzeros, dim=1)[:, : values.shape[1]]  # [groups, N]
    if scheme.zeros_minus_one:
        zeros = zeros + 1
    return _to_int4(values.t(), zeros.t(), scales.t(), scheme.group_size)


def awq_weight(scheme: PrequantizedScheme, qweight: torch.Tensor, qzeros: torch.Tensor,
               scales: torch.Tensor) -> QuantizedWeight:
    """One AWQ (GEMM layout) layer's tensors (module doc) as our int4 weight."""
    inverse = torch.tensor([AWQ_ORDER.index(i) for i in range(PACKED)])

    def columns(packed: torch.Tensor) -> torch.Tensor:
        nibbles = _unpack(packed, dim=1).view(packed.shape[0], -1, PACKED)
        return nibbles[:, :, inverse].reshape(packed.shape[0], -1)

    return _to_int4(columns(qweight).t(), columns(qzeros).t(), scales.t(), scheme.group_size)
