"""Rotary position embedding (RoPE), half-split layout as in the Hugging Face Llama/Qwen2 code.

The inverse frequencies honour the config's scaling (`rope_parameters` in transformers 5, else
`rope_scaling` + `rope_theta`): "default", "linear", "llama3", "yarn" and "longrope" (within its
original context: `served_context`); YaRN's and longrope's attention factor scales the tables, as
transformers scales its cos/sin. cos/sin are tabulated once for every
position up to the context length and indexed by position each step. A GGUF file's per-frequency
divisors (`freq_factors`, its `rope_freqs` tensor) divide the frequencies last. "dynamic" (NTK)
RoPE is served within the model's context, where transformers rotates by the plain frequencies:
past it the frequencies change with the sequence's length, which cached keys cannot follow, and
the model's context is all that is served (`served_context`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from worker_service.unsupported import UnsupportedModel

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE settings of a transformers config as one dict with `rope_type` and `rope_theta`."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    context = getattr(config, "max_position_embeddings", None)
    if params["rope_type"] in ("yarn", "longrope") and context is not None:  # transformers' own defaults
        params.setdefault("original_max_position_embeddings",
                          getattr(config, "original_max_position_embeddings", None) or context)
        params.setdefault("max_position_embeddings", context)
    return params


def rope_parameters_by_layer_type(config: Any) -> dict[str, dict[str, Any]]:
    """Each of `config.layer_types`' RoPE settings: its own where `rope_parameters` is keyed by
    layer type (Gemma 3, OLMo 3; transformers then reads those alone, whatever else the dict
    holds), else the one set for every type."""
    params = dict(config.rope_parameters)
    kinds = set(config.layer_types)
    if all(isinstance(params.get(kind), dict) for kind in kinds):
        return {kind: params[kind] for kind in kinds}
    return {kind: params for kind in kinds}


def served_context(config: Any) -> int:
    """The longest sequence served: the model's context, but for longrope its original context.

    Longrope (Phi-3.5, the 128k Phi-3s) switches every position to its long factors once the
    sequence outgrows the original context, which the keys already cached cannot follow; within
    it, transformers rotates by the short factors, as here."""
    params = rope_parameters(config)
    if params["rope_type"] == "longrope":
        return min(config.max_position_embeddings, params["original_max_position_embeddings"])
    return config.max_position_embeddings


def inverse_frequencies(params: dict[str, Any], rotary_dim: int) -> torch.Tensor:
    """float32 [rotary_dim / 2] inverse frequencies, scaled as `params["rope_type"]` says."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    wavelengths = params["rope_theta"] ** exponents  # over 2 pi
    inv_freq = 1.0 / wavelengths
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, params)
    elif rope_type == "yarn":
        inv_freq = _yarn_scaling(wavelengths, params, rotary_dim)
    elif rope_type == "longrope":  # the short factors: see `served_context`
        inv_freq = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * wavelengths)
    # "dynamic": within the context its base is rope_theta, the plain frequencies (`served_context`).
    factors = params.get("freq_factors")  # a GGUF file's per-frequency divisors (worker_service/gguf_config.py)
    if factors is not None:
        if len(factors) != rotary_dim // 2:
            raise UnsupportedModel(f"{len(factors)} RoPE frequency factors for {rotary_dim // 2} frequencies")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return inv_freq


def attention_factor(params: dict[str, Any]) -> float:
    """What the cos/sin tables are multiplied by: YaRN's or longrope's attention temperature, else 1.

    Given, or 0.1 ln(factor) + 1 (the YaRN paper's sqrt(1/t)), or with DeepSeek's `mscale` and
    `mscale_all_dim` the ratio of that formula at the two."""
    if params["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _stretch(params)
    if params["rope_type"] == "longrope":  # sqrt(1 + ln(factor) / ln(original context))
        old_context = params["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_context))
    if params.get("mscale") and params.get("mscale_all_dim"):
        return yarn_temperature(factor, params["mscale"]) / yarn_temperature(factor, params["mscale_all_dim"])
    return yarn_temperature(factor)


def yarn_temperature(factor: float, scale: float = 1.0) -> float:
    """YaRN's 0.1 `scale` ln(`factor`) + 1 (1 for a factor of at most 1): its attention factor,
    and DeepSeek's mscale."""
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


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


def _stretch(params: dict[str, Any]) -> float:
    """YaRN's or longrope's stretch of the context: given, or the ratio of the two lengths
    (DeepSeek-V3's and Phi-3's configs)."""
    if params.get("factor") is not None:
        return params["factor"]
    if params.get("max_position_embeddings") is None:
        raise UnsupportedModel("yarn RoPE without a factor")
    return params["max_position_embeddings"] / params["original_max_position_embeddings"]


def _yarn_scaling(wavelengths: torch.Tensor, params: dict[str, Any], rotary_dim: int) -> torch.Tensor:
    """YaRN ("NTK-by-parts"): the dimensions that turn more than `beta_fast` times over the
    original context keep their frequency, those turning fewer than `beta_slow` times are
    slowed by `factor`, and a linear ramp over the dimension index blends the two between."""
    factor = _stretch(params)
    old_context = params["original_max_position_embeddings"]
    base = params["rope_theta"]

    def dimension_turning(times: float) -> float:
        """The (fractional) dimension index whose wavelength fits `times` into the old context."""
        return rotary_dim * math.log(old_context / (times * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_turning(params.get("beta_fast") or 32), dimension_turning(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: the original frequency (fast dimensions); 0: slowed by the factor
    # 1 / (factor * w), not (1 / w) / factor: transformers' rounding, bit for bit.
    return 1.0 / (factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept


class RotaryEmbedding(torch.nn.Module):
    def __init__(
        self,
        config: Any,
        head_dim: int,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        rotate: bool = True,
        allow_partial: bool = False,
        interleaved: bool = False,
    ) -> None:
        """`rotate=False`: the tables of a layer without RoPE (cos 1, sin 0; SmolLM3's NoPE layers),
        through which a rotation returns its input exactly.

        A partial rotation (`partial_rotary_factor`: the first `rotary_dim` of a head's dims
        rotate, in halves of `rotary_dim / 2`, the rest pass through) is served on the whole-head
        layout: `permutation` is the order of a head's dims that puts the two rotary halves at
        the head's two halves and the passing dims after them, and the tables hold cos 1, sin 0
        for those. A model that permutes its q and k rows so at load (the scores are the same
        sums, over dims in another order) asks for it with `allow_partial`. `interleaved`: the
        rotary dims pair as (2i, 2i + 1) (GLM's), which `permutation` turns into halves the same
        way, whole heads included."""
        super().__init__()
        params = rope_parameters(config)
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        if rotary_dim != head_dim and (not allow_partial or rotary_dim % 2 or (head_dim - rotary_dim) % 2):
            raise UnsupportedModel(f"partial rotary embeddings ({rotary_dim} of {head_dim} dims) are not "
                                   "supported for this model")
        self.permutation: torch.Tensor | None = (
            rotary_order(head_dim, rotary_dim, interleaved) if interleaved or rotary_dim != head_dim else None)
        inv_freq = inverse_frequencies(params, rotary_dim) if rotate else torch.zeros(rotary_dim // 2)
        scale = attention_factor(params) if rotate else 1.0
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        passing = (head_dim - rotary_dim) // 2
        cos = torch.cat([angles.cos() * scale, torch.ones(max_positions, passing)], dim=-1)
        sin = torch.cat([angles.sin() * scale, torch.zeros(max_positions, passing)], dim=-1)
        # [max_positions, head_dim]: the half-split layout repeats each frequency twice.
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1).to(device=device, dtype=dtype), persistent=False)
        # sin with the first half negated: `apply_rotary` then needs no negation of its own.
        self.register_buffer("sin", torch.cat([-sin, sin], dim=-1).to(device=device, dtype=dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin `[T, 1, head_dim]` for positions `[T]`; looked up once per step, used by every layer."""
        return (self.cos.index_select(0, positions).unsqueeze(1),
                self.sin.index_select(0, positions).unsqueeze(1))


def rotary_order(head_dim: int, rotary_dim: int, interleaved: bool = False) -> torch.Tensor:
    """The order of a head's dims under which a rotation of the first `rotary_dim` (pairs i and
    i + rotary_dim / 2; `interleaved`: pairs 2i and 2i + 1, GLM's) becomes the whole head's (pairs
    i and i + head_dim / 2): each half of the head holds one of each pair, then half of the
    passing dims."""
    half, passing = rotary_dim // 2, (head_dim - rotary_dim) // 2
    firsts, seconds = ((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)) if interleaved
                       else (torch.arange(0, half), torch.arange(half, rotary_dim)))
    return torch.cat([firsts, torch.arange(rotary_dim, rotary_dim + passing),
                      seconds, torch.arange(rotary_dim + passing, head_dim)])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x `[T, heads, head_dim]` by `RotaryEmbedding.lookup`'s cos/signed sin (half-split pairs).

    x * cos + [-x2, x1] * sin, where the sign lives in the table: four kernels per call instead
    of five (no negation), which counts in a decode step of 30 layers. Each product is rounded
    before the sum, as in the reference code (a fused addcmul would not be, and half-precision
    logits would drift from transformers').
    """
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # [x2, x1]
    return x * cos + swapped * sin
