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
