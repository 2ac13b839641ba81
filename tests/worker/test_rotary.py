"""RoPE as the worker applies it equals transformers' `apply_rotary_pos_emb` bit for bit.

The worker keeps the sign of `rotate_half` in its sin table and swaps the halves with a roll; the
products and the sum must still round exactly as the reference's do, in every dtype.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from worker_service.layers.rotary import RotaryEmbedding, apply_rotary

HEAD_DIM = 16
MAX_POSITIONS = 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotation_equals_transformers(dtype: torch.dtype) -> None:
    config = LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, rope_theta=10000.0)
    rotary = RotaryEmbedding(config, HEAD_DIM, MAX_POSITIONS, dtype, torch.device("cpu"))
    positions = torch.tensor([0, 5, 17, 63, 31])
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 4, HEAD_DIM, generator=generator).to(dtype)
    k = torch.randn(len(positions), 2, HEAD_DIM, generator=generator).to(dtype)

    # The reference's tables: cos / sin of the same angles, [1, T, D] with heads on dim 1.
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = torch.outer(positions.float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                        cos.unsqueeze(0), sin.unsqueeze(0))
    rope = rotary.lookup(positions)
    assert torch.equal(apply_rotary(q, *rope), q_ref.squeeze(0).transpose(0, 1))
    assert torch.equal(apply_rotary(k, *rope), k_ref.squeeze(0).transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("params", [
    {"factor": 4.0, "original_max_position_embeddings": 16},
    {"factor": 8.0, "original_max_position_embeddings": 8, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"factor": 2.0, "original_max_position_embeddings": 32, "mscale": 0.9, "mscale_all_dim": 0.5},
    {"factor": 3.0, "original_max_position_embeddings": 32, "attention_factor": 1.25},
], ids=["plain", "betas-untruncated", "mscale", "attention-factor"])
def test_yarn_tables_equal_transformers(params: dict, dtype: torch.dtype) -> None:
    """YaRN's frequencies and attention factor: the worker's cos/sin tables are transformers'
    cos/sin (times its attention scaling) at every position, rounded the same."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=MAX_POSITIONS,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **params})
    rotary = RotaryEmbedding(config, HEAD_DIM, MAX_POSITIONS, dtype, torch.device("cpu"))
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    assert scaling != 1.0 or params.get("attention_factor") == 1.0
    angles = torch.outer(torch.arange(MAX_POSITIONS).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    assert torch.equal(rotary.cos, (angles.cos() * scaling).to(dtype))
    assert torch.equal(rotary.sin.abs(), (angles.sin() * scaling).to(dtype).abs())
