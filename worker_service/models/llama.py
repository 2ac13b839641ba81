"""Llama (and, with q/k/v biases, Qwen2) as one tensor-parallel rank computes it.

Per layer: RMSNorm -> merged q/k/v projection (column-parallel over this rank's heads) -> RoPE ->
paged attention -> o_proj (row-parallel, all-reduce) -> residual -> RMSNorm -> merged gate/up
(column-parallel) -> SwiGLU -> down_proj (row-parallel, all-reduce) -> residual. Tokens of all
entries are one flat batch `[T, hidden]`; only attention knows where sequences begin and end.

Each residual add is done together with the RMSNorm after it (`RMSNorm.add`): a layer returns its
MLP's output and the running residual, and the next layer's input norm adds them. With the
compiled kernels (`worker_service.native`, set as `kernels` by the model runner) that add and
norm, SwiGLU, and RoPE with the K/V write are one pass each; the results are the same as the
PyTorch ops' in half precision (the same roundings) and within float32's last bits in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from worker_service.attention import AttentionBatch, paged_attention
from worker_service.distributed import TPGroup
from worker_service.kv_pool import KVPool
from worker_service.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker_service.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker_service.layers.norm import RMSNorm
from worker_service.layers.rotary import RotaryEmbedding, apply_rotary
from worker_service.layers.sharding import balanced_range, shard_heads

if TYPE_CHECKING:
    from worker_service.layers.fused_layer import FusedDecode
    from worker_service.layers.triton_ops import TritonRowOps
    from worker_service.native import NativeKernels


@dataclass(slots=True)
class StepContext:
    """What every layer needs for one forward pass besides the hidden states."""

    positions: torch.Tensor  # [T]
    attention: AttentionBatch
    pool: KVPool


# cos, signed sin: [T, 1, head_dim] at the step's positions on the torch path; the whole tables
# [max_positions, head_dim] with the compiled or Triton kernels, which look the positions up themselves.
Rope = tuple[torch.Tensor, torch.Tensor]


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(torch.nn.Module):
    # Set by the model runner on CUDA with Triton: RoPE and the K/V write in one kernel.
    rope_kernels: TritonRowOps | None = None

    def __init__(
        self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.head_dim = head_dim_of(config)
        heads = shard_heads(config.num_attention_heads, config.num_key_value_heads,
                            group.world_size, group.rank)
        self.num_q_heads, self.num_kv_heads = heads.num_q_heads, heads.num_kv_heads
        prefix = f"model.layers.{layer}.self_attn"
        d = self.head_dim
        q_rows = range(heads.q_heads.start * d, heads.q_heads.stop * d)
        kv_rows = range(heads.kv_heads.start * d, heads.kv_heads.stop * d)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [(f"{prefix}.q_proj", q_rows), (f"{prefix}.k_proj", kv_rows), (f"{prefix}.v_proj", kv_rows)],
            qkv_bias, dtype, device,
        )
        self.o_proj = RowParallelLinear(f"{prefix}.o_proj", q_rows, config.hidden_size, group, dtype, device)

    def forward(self, hidden: torch.Tensor, step: StepContext, rope: Rope) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, self.num_q_heads + 2 * self.num_kv_heads, self.head_dim)
        k_slots, v_slots = step.pool.slots(self.layer)
        native = step.attention.native
        if native is not None:
            # One pass rotates q and k in place and stores k and v; the kernel reads q where it is.
            native.kernels.rope_store(qkv, self.num_q_heads, step.positions, *rope, k_slots, v_slots,
                                      step.attention.write_slots)
            attended = native.attend(qkv[:, : self.num_q_heads], k_slots, v_slots)
        elif self.rope_kernels is not None:
            # q and k rotated in place, k and v already in the pool.
            self.rope_kernels.rope_store(qkv, self.num_q_heads, step.positions, *rope, k_slots, v_slots,
                                         step.attention.write_slots)
            q, k, v = qkv.split([self.num_q_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
            attended = paged_attention(q, k, v, k_slots, v_slots, step.attention, stored=True)
        else:
            # q and k sit side by side in the merged output: rotate both with one call.
            qk = apply_rotary(qkv[:, : self.num_q_heads + self.num_kv_heads], *rope)
            q, k = qk.split([self.num_q_heads, self.num_kv_heads], dim=1)
            v = qkv[:, self.num_q_heads + self.num_kv_heads:]
            attended = paged_attention(q, k, v, k_slots, v_slots, step.attention)
        return self.o_proj(attended.reshape(num_tokens, self.num_q_heads * self.head_dim))


class LlamaMLP(torch.nn.Module):
    def __init__(self, config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r} (only silu)")
        prefix = f"model.layers.{layer}.mlp"
        features = balanced_range(config.intermediate_size, group.world_size, group.rank)
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [(f"{prefix}.gate_proj", features), (f"{prefix}.up_proj", features)],
            False, dtype, device,
        )
        self.down_proj = RowParallelLinear(f"{prefix}.down_proj", features, config.hidden_size, group,
                                           dtype, device)
        self.kernels: NativeKernels | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(hidden)
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(torch.nn.Module):
    def __init__(
        self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}"
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(f"{prefix}.input_layernorm.weight", config.hidden_size, eps, dtype, device)
        self.self_attn = LlamaAttention(config, layer, group, qkv_bias, dtype, device)
        self.post_attention_layernorm = RMSNorm(
            f"{prefix}.post_attention_layernorm.weight", config.hidden_size, eps, dtype, device
        )
        self.mlp = LlamaMLP(config, layer, group, dtype, device)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, step: StepContext, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden`: the previous layer's MLP output (the embeddings for the first layer, whose
        `residual` is None); returns this layer's MLP output and the residual stream before it."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add(hidden, residual)
        normed, residual = self.post_attention_layernorm.add(self.self_attn(normed, step, rope), residual)
        return self.mlp(normed), residual


class LlamaForCausalLM(torch.nn.Module):
    """Checkpoint names follow Hugging Face's `LlamaForCausalLM`."""

    qkv_bias = False
    # Set by the model runner where a whole layer runs as one compiled call (`layers/fused_layer.py`).
    fused: FusedDecode | None = None

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if getattr(config, "attention_bias", False) and not self.qkv_bias:
            raise ValueError("Llama checkpoints with attention_bias=True are not supported")
        if getattr(config, "mlp_bias", False):
            raise ValueError("Llama checkpoints with mlp_bias=True are not supported")
        self.config = config
        self.group = group
        self.num_kv_heads = shard_heads(config.num_attention_heads, config.num_key_value_heads,
                                        group.world_size, group.rank).num_kv_heads
        self.embed_tokens = VocabParallelEmbedding(
            "model.embed_tokens.weight", config.vocab_size, config.hidden_size, group, dtype, device
        )
        self.rotary = RotaryEmbedding(config, head_dim_of(config), config.max_position_embeddings, dtype, device)
        self.layers = torch.nn.ModuleList(
            LlamaDecoderLayer(config, i, group, self.qkv_bias, dtype, device)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm("model.norm.weight", config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = ParallelLMHead(
            "lm_head.weight", config.vocab_size, config.hidden_size, group, dtype, device,
            tied_to=self.embed_tokens if config.tie_word_embeddings else None,
        )

    def forward(
        self, token_ids: torch.Tensor, step: StepContext, sample_indices: torch.Tensor
    ) -> torch.Tensor | None:
        """Logits `[len(sample_indices), vocab]` of the chosen tokens, on rank 0 (None elsewhere)."""
        hidden = self.embed_tokens(token_ids)
        if self.fused is not None and self.fused.applies(len(token_ids), step):
            hidden, residual = self.fused.run(hidden, step)  # the same kernels, one call per layer
        else:
            # Kernels that look RoPE's positions up themselves take the whole tables.
            looks_up = step.attention.native is not None or self.layers[0].self_attn.rope_kernels is not None
            rope = (self.rotary.cos, self.rotary.sin) if looks_up else self.rotary.lookup(step.positions)
            residual = None
            for layer in self.layers:
                hidden, residual = layer(hidden, residual, step, rope)
        hidden = hidden + residual
        # Only the sampled positions need the final norm and the (large) LM head.
        return self.lm_head(self.norm(hidden.index_select(0, sample_indices)))
