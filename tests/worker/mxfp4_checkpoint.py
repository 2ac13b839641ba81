"""A tiny GPT-OSS checkpoint whose experts are MXFP4 blocks, as the released gpt-oss checkpoints
ship them (`quantization_config: {quant_method: mxfp4}`, `<name>_blocks` and `<name>_scales` in
`[out, in]` order), made from `families.py`'s plain one: each group of 32 weights gets the power
of two that fits its largest in 6 and every weight its nearest E2M1 code. The reference reads
the file back with transformers' own MXFP4 dequantization (`Mxfp4Config(dequantize=True)`), so
what this rounding does is the checkpoint, not what is checked."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from worker.families import make_family

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[E, out, in]` (in a multiple of 32) -> (blocks `[E, out, in / 32, 16]`, scales `[E, out, in / 32]`)."""
    experts, rows, cols = weight.shape
    groups = weight.float().view(experts, rows, cols // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = ((scaled.abs().unsqueeze(-1) - GRID).abs().argmin(-1) + 8 * (scaled < 0)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def make_mxfp4_gpt_oss(out_dir: Path, seed: int = 0, **overrides) -> Path:
    plain = make_family("gpt_oss", out_dir / "plain", seed, **overrides)
    quantized = out_dir / "mxfp4"
    quantized.mkdir()
    tensors = {}
    for name, value in load_file(plain / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # stored [E, in, out]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize(value.transpose(1, 2))
        else:
            tensors[name] = value
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    for path in plain.iterdir():
        if path.name != "model.safetensors":
            (quantized / path.name).write_bytes(path.read_bytes())
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    return quantized
