"""Tiny random Llama checkpoints pre-quantized as GPTQ or AWQ int4, and their float twins.

The packing follows the formats' documented layouts, written here with numpy independently of
the worker's reader (`worker_service/quant/prequantized.py`):
- GPTQ: `qweight` int32 `[K / 8, N]`, eight 4-bit values along the input dimension (lowest
  nibble first); `qzeros` int32 `[K / group, N / 8]` along the output dimension, each zero stored
  minus one in the classic checkpoint format (`gptq`), as it is in `gptq_v2`; `scales` float16
  `[K / group, N]`; `g_idx` int32 `[K]` = k // group (no act-order).
- AWQ (GEMM): `qweight` int32 `[K, N / 8]` and `qzeros` `[K / group, N / 8]` along the output
  dimension in the order (0, 2, 4, 6, 1, 3, 5, 7); zeros as they are; `scales` `[K / group, N]`.
Both stand for w = scale * (q - zero). Weights are quantized round-to-nearest per group
(symmetric: zero 8 and scale max|w| / 7.5; asymmetric: the group's range over 15).

`write_prequantized` writes the quantized folder (its config holding `quantization_config`) and
a plain folder whose linear weights are `dequantize`d from the packed tensors by the spec: the
reference transformers loads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from worker.tiny_models import make_tiny_llama

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Every linear layer's input and output sizes are multiples of 128 (groups of 32, 64 or 128) or of 8.
SHAPES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=16)


def quantize(weight: np.ndarray, group: int, sym: bool, min_zero: int = 0) -> tuple[np.ndarray, ...]:
    """`weight` `[N, K]` -> values `[N, K]`, zeros `[N, K / group]` (ints) and float16 scales."""
    n, k = weight.shape
    groups = weight.reshape(n, k // group, group).astype(np.float32)
    if sym:
        scales = (np.abs(groups).max(axis=2) / 7.5).astype(np.float16)
        zeros = np.full(scales.shape, 8, dtype=np.int64)
    else:
        low, high = groups.min(axis=2), groups.max(axis=2)
        scales = ((high - low) / 15).astype(np.float16)
        zeros = np.clip(np.round(-low / scales.astype(np.float32)), min_zero, 15).astype(np.int64)
    safe = np.where(scales == 0, np.float16(1), scales).astype(np.float32)
    values = np.clip(np.round(groups / safe[:, :, None]) + zeros[:, :, None], 0, 15).astype(np.int64)
    return values.reshape(n, k), zeros, scales


def _pack_columns(ints: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """`[R, C]` 4-bit ints -> int32 `[R, C / 8]`, nibble i of word c holding column 8 c + order[i]."""
    words = np.zeros((ints.shape[0], ints.shape[1] // 8), dtype=np.uint32)
    for i, column in enumerate(order):
        words |= (ints[:, column::8].astype(np.uint32) & 0xF) << np.uint32(4 * i)
    return words.view(np.int32)


def pack(method: str, values: np.ndarray, zeros: np.ndarray, scales: np.ndarray, group: int,
         zeros_minus_one: bool) -> dict[str, np.ndarray]:
    """One layer's tensors in `method`'s layout (module doc)."""
    k = values.shape[1]
    if method == "gptq":
        qweight = _pack_columns(values).T  # word r of output n: inputs 8 r .. 8 r + 7
        stored = zeros.T - (1 if zeros_minus_one else 0)
        return {"qweight": np.ascontiguousarray(qweight), "qzeros": _pack_columns(stored),
                "scales": np.ascontiguousarray(scales.T), "g_idx": (np.arange(k) // group).astype(np.int32)}
    return {"qweight": _pack_columns(values.T, AWQ_ORDER), "qzeros": _pack_columns(zeros.T, AWQ_ORDER),
            "scales": np.ascontiguousarray(scales.T)}


def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 `[R, C]` -> `[R, C, 8]` 4-bit values, lowest nibble first."""
    return (words.view(np.uint32)[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF


def dequantize(method: str, tensors: dict[str, np.ndarray], zeros_minus_one: bool) -> np.ndarray:
    """The float32 `[N, K]` weight a layer's packed tensors stand for, by the spec (module doc)."""
    scales = tensors["scales"].astype(np.float32)  # [G, N]
    if method == "gptq":
        qweight = _nibbles(tensors["qweight"])  # [K / 8, N, 8]: input 8 r + j
        q = qweight.transpose(0, 2, 1).reshape(-1, qweight.shape[1])  # [K, N]
        zeros = _nibbles(tensors["qzeros"]).reshape(scales.shape).astype(np.int64) + (1 if zeros_minus_one else 0)
        g_idx = tensors["g_idx"]
    else:
        def unpack(words: np.ndarray) -> np.ndarray:
            nibbles = _nibbles(words)  # [R, C, 8]: output 8 c + AWQ_ORDER[i]
            out = np.empty_like(nibbles)
            out[:, :, list(AWQ_ORDER)] = nibbles
            return out.reshape(words.shape[0], -1)

        q, zeros = unpack(tensors["qweight"]), unpack(tensors["qzeros"]).astype(np.int64)
        g_idx = np.arange(q.shape[0]) // (q.shape[0] // scales.shape[0])
    weight = scales[g_idx] * (q.astype(np.int64) - zeros[g_idx]).astype(np.float32)  # [K, N]
    return np.ascontiguousarray(weight.T)


def write_prequantized(folder: Path, method: str, group: int, sym: bool, checkpoint_format: str = "gptq",
                       seed: int = 0) -> tuple[Path, Path]:
    """(the quantized checkpoint, its dequantized float32 twin) in `folder` (module doc)."""
    plain = make_tiny_llama(folder / "plain", seed=seed, **SHAPES)
    quantized = folder / "quantized"
    shutil.copytree(plain, quantized)
    tensors = load_file(plain / "model.safetensors")
    zeros_minus_one = method == "gptq" and checkpoint_format == "gptq"
    packed_all: dict[str, np.ndarray] = {}
    for name in list(tensors):
        if not any(name.endswith(f"{linear}.weight") for linear in LINEARS):
            continue
        base = name[: -len(".weight")]
        values, zeros, scales = quantize(tensors[name], group, sym, min_zero=1 if zeros_minus_one else 0)
        packed = pack(method, values, zeros, scales, group, zeros_minus_one)
        tensors[name] = dequantize(method, packed, zeros_minus_one)
        packed_all.update({f"{base}.{part}": array for part, array in packed.items()})
    quantized_tensors = {name: array for name, array in tensors.items() if name[: -len(".weight")] + ".qweight"
                         not in packed_all}
    save_file({**quantized_tensors, **packed_all}, quantized / "model.safetensors", metadata={"format": "pt"})
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    if method == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym,
                                         "desc_act": False, "checkpoint_format": checkpoint_format}
    else:
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                         "zero_point": True, "version": "gemm"}
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, plain
