"""Phi-3: Llama's layer with q/k/v stored as one `qkv_proj` and gate/up as one `gate_up_proj`.

The merged checkpoint tensors are split at load, per TP shard: this rank's q, k and v rows are
three row ranges of `qkv_proj` (q at 0, k after all query heads, v after all key heads), its gate
and up rows two ranges of `gate_up_proj`, read with the same `get_slice` as separate tensors.
The computation is Llama's exactly, so the model keeps Llama's fusable layer. Phi-3 (Phi-4-mini)
may rotate only part of each head (`partial_rotary_factor`, as transformers' class does): its q
and k rows are put in the order `RotaryEmbedding.permutation` gives at load, so that every
backend's whole-head rotation over tables that leave the other dims alone computes it.
"""

from __future__ import annotations

from typing import Any

from worker_service.models.config_checks import EVERY_LAYER
from worker_service.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, head_dim_of


def _shifted(rows: range, offset: int) -> range:
    return range(rows.start + offset, rows.stop + offset)


class Phi3Attention(LlamaAttention):
    def qkv_pieces(self, config: Any, prefix: str, q_rows: range, kv_rows: range) -> list[tuple[str, range]]:
        q_width = config.num_attention_heads * head_dim_of(config)
        kv_width = config.num_key_value_heads * head_dim_of(config)
        merged = f"{prefix}.qkv_proj"
        return [(merged, q_rows), (merged, _shifted(kv_rows, q_width)), (merged, _shifted(kv_rows, q_width + kv_width))]


class Phi3MLP(LlamaMLP):
    def gate_up_pieces(self, config: Any, prefix: str, features: range) -> list[tuple[str, range]]:
        merged = f"{prefix}.gate_up_proj"
        return [(merged, features), (merged, _shifted(features, config.intermediate_size))]


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_class = Phi3Attention
    mlp_class = Phi3MLP


class Phi3ForCausalLM(LlamaForCausalLM):
    layer_class = Phi3DecoderLayer
    partial_rotary = True  # Phi-4-mini's 0.75 (see `RotaryEmbedding`)
    window_rule = EVERY_LAYER  # Phi-3-mini-4k's 2,047 under its 4,096
