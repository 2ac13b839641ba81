"""Llama (and, with q/k/v biases, Qwen2) as one tensor-parallel rank computes it.

Per layer: RMSNorm -> merged q/k/v projection (column-parallel over this rank's heads) -> RoPE ->
paged attention -> o_proj (row-parallel, all-reduce) -> residual -> RMSNorm -> merged gate/up
(column-parallel) -> SwiGLU -> down_proj (row-parallel, all-reduce) -> residual. Tokens of all
entries are one flat batch `[T, hidden]`; only attention knows where sequences begin and end.

Each residual add is done together with the RMSNorm after it (`RMSNorm.add`): a layer returns its
MLP's output and the running residual, and the next layer's input norm adds them. Attention, the
norms, SwiGLU and the linear layers are the backend's (`worker_service.backends`), whichever it is.

The layer is the one the compiled kernels run whole (`backends/fused_llama.py`), so the model
declares `fusable_layer = "llama"`; a subclass whose layer differs must declare None.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from worker_service.backends.base import AttentionOptions, Backend, Rope, StepContext
from worker_service.distributed import TPGroup
from worker_service.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker_service.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker_service.layers.norm import RMSNorm
from worker_service.layers.rotary import RotaryEmbedding, served_context
from worker_service.layers.sharding import balanced_range, shard_heads
from worker_service.models.base import CausalLM, head_dim_of
from worker_service.models.config_checks import IGNORED, layer_windows
from worker_service.quant.format import QuantizedWeight
from worker_service.unsupported import UnsupportedModel


class LlamaAttention(torch.nn.Module):
    options: AttentionOptions | None = None  # a family's window, soft-cap, scale or sinks
    o_bias = False  # whether o_proj has a bias (GPT-OSS's)
    # Whether `reorder_qk` also reorders what `prepare_qk` applies over a head's dims (q/k norms' weights).
    norms_follow_order = False

    def __init__(
        self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
        dtype: torch.dtype, device: torch.device, backend: Backend,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.layer = layer
        self.head_dim = head_dim_of(config)
        heads = shard_heads(config.num_attention_heads, config.num_key_value_heads,
                            group.world_size, group.rank)
        self.num_q_heads, self.num_kv_heads = heads.num_q_heads, heads.num_kv_heads
        prefix = f"model.layers.{layer}.self_attn"
        d = self.head_dim
        q_rows = range(heads.q_heads.start * d, heads.q_heads.stop * d)
        kv_rows = range(heads.kv_heads.start * d, heads.kv_heads.stop * d)
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, self.qkv_pieces(config, prefix, q_rows, kv_rows),
                                             qkv_bias, dtype, device)
        self.o_proj = RowParallelLinear(f"{prefix}.o_proj", q_rows, config.hidden_size, group, dtype, device,
                                        bias=self.o_bias)

    def qkv_pieces(self, config: Any, prefix: str, q_rows: range, kv_rows: range) -> list[tuple[str, range]]:
        """Where this rank's q, k and v rows are in the checkpoint (separate projections here)."""
        return [(f"{prefix}.q_proj", q_rows), (f"{prefix}.k_proj", kv_rows), (f"{prefix}.v_proj", kv_rows)]

    def prepare_qk(self, qkv: torch.Tensor) -> None:
        """What a family does to q and k between the projection and RoPE, in place (Llama: nothing)."""

    def reorder_qk(self, order: torch.Tensor) -> None:
        """Put each q and k head's rows (and biases) in `order` (`RotaryEmbedding.permutation`);
        v's stay. q . k sums the same products in another order. A GGUF or GPTQ/AWQ checkpoint's
        quantized rows are reordered as they are (each row is whole)."""
        d, qk_heads = self.head_dim, self.num_q_heads + self.num_kv_heads
        rows = torch.cat([head * d + order for head in range(qk_heads)] +
                         [torch.arange(qk_heads * d, (qk_heads + self.num_kv_heads) * d)])
        for param in (self.qkv_proj.weight, self.qkv_proj.bias):
            if param is not None and param.numel():
                param.data = param.data.index_select(0, rows.to(param.device))
        blocks = self.qkv_proj.checkpoint_quantized
        if blocks is not None:
            self.qkv_proj.checkpoint_quantized = _reorder_blocks(blocks, rows)

    def attend(self, hidden: torch.Tensor, step: StepContext, rope: Rope) -> torch.Tensor:
        """Every head's attention output `[T, Hq * D]`, before o_proj."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, self.num_q_heads + 2 * self.num_kv_heads, self.head_dim)
        self.prepare_qk(qkv)
        k_slots, v_slots = step.pool.slots(self.layer)
        attended = self.backend.attention(qkv, self.num_q_heads, k_slots, v_slots, step, rope, self.options)
        return attended.reshape(num_tokens, self.num_q_heads * self.head_dim)

    def forward(self, hidden: torch.Tensor, step: StepContext, rope: Rope) -> torch.Tensor:
        return self.o_proj(self.attend(hidden, step, rope))


def _reorder_blocks(blocks: list[QuantizedWeight], rows: torch.Tensor) -> list[QuantizedWeight]:
    """Row blocks (q/k and v may differ in layout) with their rows in the order `rows` gives;
    a block's rows must stay in it (they do: heads are whole within the q, k and v tensors)."""
    reordered, start = [], 0
    for block in blocks:
        stop = start + block.out_features
        local = rows[start:stop] - start
        if local.min() < 0 or local.max() >= block.out_features:
            raise UnsupportedModel("partial rotary embeddings over quantized q/k rows whose blocks cut a head")
        reordered.append(block.take_rows(local))
        start = stop
    return reordered


class LlamaMLP(torch.nn.Module):
    activation = "silu"  # the checkpoint's activation this MLP computes (`activate`)

    def __init__(self, config: Any, layer: int, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend, prefix: str | None = None, intermediate_size: int | None = None,
                 reduce: bool = True) -> None:
        """The layer's MLP, or another of the same kind (Qwen2-MoE's shared expert: its `prefix`,
        its width, and with `reduce=False` this rank's partial output, which the caller sums)."""
        super().__init__()
        self.backend = backend
        activation = getattr(config, "hidden_activation", None) or config.hidden_act
        if activation != self.activation:
            raise UnsupportedModel(f"unsupported activation {activation!r} (only {self.activation})")
        prefix = prefix or f"model.layers.{layer}.mlp"
        features = balanced_range(intermediate_size or config.intermediate_size, group.world_size, group.rank)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, self.gate_up_pieces(config, prefix, features),
                                                 False, dtype, device)
        self.down_proj = RowParallelLinear(f"{prefix}.down_proj", features, config.hidden_size, group,
                                           dtype, device, reduce=reduce)

    def gate_up_pieces(self, config: Any, prefix: str, features: range) -> list[tuple[str, range]]:
        """Where this rank's gate and up rows are in the checkpoint (separate projections here)."""
        return [(f"{prefix}.gate_proj", features), (f"{prefix}.up_proj", features)]

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.backend.silu_mul(gate_up)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activate(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(torch.nn.Module):
    # What a family varies (`models/qwen3.py` etc.): its attention's and its MLP's class.
    attention_class: type[LlamaAttention] = LlamaAttention
    mlp_class: type[torch.nn.Module] = LlamaMLP

    def __init__(
        self, config: Any, layer: int, group: TPGroup, qkv_bias: bool,
        dtype: torch.dtype, device: torch.device, backend: Backend,
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}"
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(f"{prefix}.input_layernorm.weight", config.hidden_size, eps, dtype, device,
                                       backend)
        self.self_attn = self.attention_class(config, layer, group, qkv_bias, dtype, device, backend)
        self.post_attention_layernorm = RMSNorm(
            f"{prefix}.post_attention_layernorm.weight", config.hidden_size, eps, dtype, device, backend
        )
        self.mlp = self.mlp_class(config, layer, group, dtype, device, backend)

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


class NormsAroundBlocks:
    """`forward` for a decoder layer whose attention and MLP outputs are normed before each joins
    the residual stream (GLM-4, AFMoE): `norms()` gives (the input norm, the norm after attention,
    the one before the MLP, the one after it), each a `RMSNorm`."""

    def norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm, RMSNorm]:
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, step: StepContext,
                rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """As `LlamaDecoderLayer.forward`: (this layer's normed MLP output, the residual before it)."""
        before_attention, after_attention, before_mlp, after_mlp = self.norms()
        if residual is None:
            residual, normed = hidden, before_attention(hidden)
        else:
            normed, residual = before_attention.add(hidden, residual)
        normed, residual = before_mlp.add(after_attention(self.self_attn(normed, step, rope)), residual)
        return after_mlp(self.mlp(normed)), residual


class LlamaForCausalLM(CausalLM):
    """Checkpoint names follow Hugging Face's `LlamaForCausalLM`."""

    qkv_bias = False
    fusable_layer = "llama"
    # Whether the family rotates only `partial_rotary_factor` of a head's dims, as transformers'
    # class does (Phi-3's); transformers' Llama, Qwen2, Mistral, Granite and Mixtral rotate whole
    # heads whatever the setting says, so there the setting is refused rather than guessed at.
    partial_rotary = False
    interleaved_rotary = False  # GLM's pairs (2i, 2i + 1) rather than halves (see `RotaryEmbedding`)
    # How transformers' class applies `sliding_window` (`config_checks.layer_windows`).
    window_rule = IGNORED
    layer_class: type[torch.nn.Module] = LlamaDecoderLayer

    def __init__(self, config: Any, group: TPGroup, dtype: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        super().__init__()
        self.backend = backend
        if getattr(config, "attention_bias", False) and not self.qkv_bias:
            raise UnsupportedModel(f"{type(self).__name__} with attention_bias=True is not supported")
        if getattr(config, "mlp_bias", False):
            raise UnsupportedModel(f"{type(self).__name__} with mlp_bias=True is not supported")
        self.config = config
        self.group = group
        self.num_kv_heads = shard_heads(config.num_attention_heads, config.num_key_value_heads,
                                        group.world_size, group.rank).num_kv_heads
        self.embed_tokens = VocabParallelEmbedding(
            "model.embed_tokens.weight", config.vocab_size, config.hidden_size, group, dtype, device
        )
        # Tables for the positions served (a longrope model's original context, not its 128k).
        self.rotary = RotaryEmbedding(config, head_dim_of(config), served_context(config), dtype, device,
                                      allow_partial=self.partial_rotary, interleaved=self.interleaved_rotary)
        self.layers = torch.nn.ModuleList(
            self.layer_class(config, i, group, self.qkv_bias, dtype, device, backend)
            for i in range(config.num_hidden_layers)
        )
        windows = layer_windows(config, self.window_rule)
        for layer, window in zip(self.layers, windows):
            if window is not None:
                layer.self_attn.options = replace(layer.self_attn.options or AttentionOptions(), window=window)
        self.shortest_window = min((window for window in windows if window is not None), default=None)
        attention_class = type(self.layers[0].self_attn)
        prepare_qk = getattr(attention_class, "prepare_qk", None)  # MLA has none
        has_qk_norms = prepare_qk not in (None, LlamaAttention.prepare_qk)
        if self.rotary.permutation is not None and has_qk_norms and not attention_class.norms_follow_order:
            raise UnsupportedModel(f"{type(self).__name__} with partial rotary embeddings (q/k norms over a "
                                   "head's dims in their order) is not supported")
        self.norm = self.final_norm(config, dtype, device)
        self.lm_head = ParallelLMHead(
            "lm_head.weight", config.vocab_size, config.hidden_size, group, dtype, device,
            tied_to=self.embed_tokens if config.tie_word_embeddings else None,
        )

    def final_norm(self, config: Any, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        """The norm after the last layer (`model.norm`): RMSNorm here."""
        return RMSNorm("model.norm.weight", config.hidden_size, config.rms_norm_eps, dtype, device, self.backend)

    @classmethod
    def ops_without_kernels(cls, config: Any) -> tuple[str, ...]:
        return ("sliding-window attention",) if any(layer_windows(config, cls.window_rule)) else ()

    def fused_applies(self, step: StepContext) -> bool:
        """Within its windows a windowed model's layers are the fused layer's computation."""
        window, batch = self.shortest_window, step.batch
        return window is None or (batch is not None and batch.longest_context is not None
                                  and batch.longest_context <= window)

    def after_load(self) -> None:
        if self.rotary.permutation is not None:
            for layer in self.layers:
                layer.self_attn.reorder_qk(self.rotary.permutation)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids)

    def run_layers(self, hidden: torch.Tensor, step: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        rope = self.backend.rope(self.rotary, step.positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, step, rope)
        return hidden, residual

    def logits(self, hidden: torch.Tensor, residual: torch.Tensor, sample_indices: torch.Tensor) -> torch.Tensor | None:
        hidden = hidden + residual
        # Only the sampled positions need the final norm and the (large) LM head.
        return self.lm_head(self.norm(hidden.index_select(0, sample_indices)))
