"""Rotary position embedding (RoPE), half-split layout as in the Hugging Face Llama/Qwen2 code.

The inverse frequencies honour the config's scaling (`rope_parameters` in transformers 5, else
`rope_scaling` + `rope_theta`): "default", "linear" and "llama3". cos/sin are tabulated once for
every position up to the context length and indexed by position each step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE settings of a transformers config as one dict with `rope_type` and `rope_theta`."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(params: dict[str, Any], rotary_dim: int) -> torch.Tensor:
    """float32 [rotary_dim / 2] inverse frequencies, scaled as `params["rope_type"]` says."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, params)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(
        self,
        config: Any,
        head_dim: int,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        params = rope_parameters(config)
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        inv_freq = inverse_frequencies(params, head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # [max_positions, head_dim]: the half-split layout repeats each frequency twice.
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().to(device=device, dtype=dtype), persistent=False)
        # sin with the first half negated: `apply_rotary` then needs no negation of its own.
        signs = torch.cat([-torch.ones(head_dim // 2), torch.ones(head_dim // 2)])
        self.register_buffer("sin", (angles.sin() * signs).to(device=device, dtype=dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin `[T, 1, head_dim]` for positions `[T]`; looked up once per step, used by every layer."""
        return (self.cos.index_select(0, positions).unsqueeze(1),
                self.sin.index_select(0, positions).unsqueeze(1))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x `[T, heads, head_dim]` by `RotaryEmbedding.lookup`'s cos/signed sin (half-split pairs).

    x * cos + [-x2, x1] * sin, where the sign lives in the table: four kernels per call instead
    of five (no negation), which counts in a decode step of 30 layers. Each product is rounded
    before the sum, as in the reference code (a fused addcmul would not be, and half-precision
    logits would drift from transformers').
    """
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # [x2, x1]
    return x * cos + swapped * sin
