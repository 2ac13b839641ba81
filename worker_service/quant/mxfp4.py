"""MXFP4 (the OCP microscaling format GPT-OSS's experts ship in) as our `int8` layout, exactly.

A checkpoint stores a quantized `<name>` as `<name>_blocks` `[..., N, K / 32, 16]` uint8 (two
4-bit E2M1 codes a byte, the low nibble first: element 2 b of a group in byte b's low nibble,
2 b + 1 in its high one) and `<name>_scales` `[..., N, K / 32]` uint8 (one E8M0 exponent, biased
by 127, per group of 32 input columns), both in `[out, in]` order whatever the plain tensor's
(GPT-OSS's plain experts are `[in, out]`). A code stands for one of ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}
(the sign in bit 3), times 2^(exponent - 127).

Twice a code's value is an integer in -12..12, so the weight is our int8 layout with groups of 32:
value 2 * code, scale 2^(exponent - 128). Every product of such an integer and a power of two is
exact in float32, so the weights are exactly those transformers dequantizes (its
`convert_moe_packed_tensors`), held in 9 bits a weight (int8 values, float32 scales) where bfloat16
takes 16. The products are the int8 ones every backend has (`backends/linear_quant.py`).
"""

from __future__ import annotations

import torch

from worker_service.quant.format import QuantizedWeight

GROUP = 32  # input columns per scale
# Twice each code's value: codes 0-7 positive, 8-15 their negatives.
_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)


def mxfp4_weight(blocks: torch.Tensor, scales: torch.Tensor, in_features: int) -> QuantizedWeight:
    """`blocks` `[N, G, 16]` and `scales` `[N, G]` (module doc) -> the int8 `QuantizedWeight` of
    the first `in_features` columns (G = ceil(in_features / 32))."""
    rows, groups, width = blocks.shape
    if width != GROUP // 2 or scales.shape != (rows, groups) or -(-in_features // GROUP) != groups:
        raise ValueError(f"mxfp4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not hold "
                         f"{in_features} columns in groups of {GROUP}")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).view(rows, groups * GROUP)
    values = _DOUBLED[codes.long()][:, :in_features].contiguous()
    # Powers of two from 2^-128 (a float32 subnormal, exact) to 2^127, made exactly in float64.
    powers = torch.exp2(scales.to(torch.float64) - 128).float().contiguous()
    return QuantizedWeight("int8", values, powers, None, GROUP, in_features)
