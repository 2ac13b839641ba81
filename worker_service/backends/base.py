"""The contract between model code and what runs it: a backend.

A backend is one way of computing a model's step: PyTorch's ops (`torch_backend.py`, the
reference every other is tested against), the compiled CPU kernels (`native_backend.py`), or
Triton with CUDA graphs (`triton_backend.py`). One is chosen per worker, once, by
`selection.select_backend`, and handed to the model's constructor; model and layer code call
its methods and never ask which backend it is.

What the runner asks of a backend, per step:
- `plan(batch, pool)`: turn the step's neutral description (`StepBatch`: the flat token layout,
  decode rows' page tables and lengths, prefill chunks) into the `StepContext` every layer reads.
  The plan (`StepContext.attention`) is the backend's own and opaque to models; it is built once
  per step and is valid for that step only.

What models call (the same calls on every backend, the same results within the dtype's rounding):
- `pack(weight, bias)`, once after loading: the weight in whatever form this backend multiplies
  with, as a `PackedLinear` the layer calls from then on. This is the one place a weight format
  enters: a quantized or differently laid out weight is a new `PackedLinear`, not a new branch
  in the layers. A quantized weight (`worker_service.quant.QuantizedWeight`) is packed by the
  backend's `quantized` (`linear_quant.QuantizedLinears`), chosen with the backend.
- `pack_experts(gate_up, down)`, once after loading, by a mixture-of-experts layer: its experts'
  weights (this rank's slices) as one `PackedExperts` computing the whole grouped product in one
  call, or None where this backend has no such call (the layer then multiplies expert by expert).
- `rope(rotary, positions)`, once per step: what `attention` takes as its `rope` argument.
- `attention(qkv, num_q_heads, k_slots, v_slots, step, rope, options)`: RoPE on q and k, the new
  K/V written into the pool at `step.write_slots`, then attention of every token over its
  sequence's pages. Backends that fuse the rotation and the write do so; the result is the same.
  `options` (`AttentionOptions`: a sliding window, logit soft-capping, a softmax scale other than
  1/sqrt(head_dim)) are computed by PyTorch's ops on every backend (`attention/windowed.py`):
  no compiled or Triton kernel has them, and the selection's reason says so for such a model.
- `rms_norm`, `add_rms_norm` (the residual add fused with the norm after it), `silu_mul` (SwiGLU),
  `gelu_tanh_mul` (GELU-tanh gating; PyTorch's ops on every backend).

What the runner may ask for once, after loading (None where the backend has no such feature):
- `fused_layers(model, pool)`: the model's decoder layers as one compiled call each, for the
  layer kinds the backend has fused code for. A model opts in by declaring `fusable_layer`
  (see `worker_service/models/base.py`); an undeclared model never gets one.
- `whole_steps(model, pool, context_len, pad_page)`: whole decode steps replayed (CUDA graphs),
  for which the pool needs `extra_pages` more pages than the router is told of.
- `new_sampler(seed)`: rank 0's sampler with this backend's sampling kernels, if any.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

import torch

from worker_service.forward_batch import ForwardEntry
from worker_service.kv_pool import KVPool
from worker_service.layers.rotary import RotaryEmbedding
from worker_service.quant.format import QuantizedWeight
from worker_service.sampling import Sampler

# cos and signed sin as `Backend.rope` gives them: looked up at the step's positions
# (`[T, 1, head_dim]`) or the whole tables (`[max_positions, head_dim]`) for kernels that look
# the positions up themselves.
Rope = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True, frozen=True)
class PrefillChunk:
    """A prefill entry's tokens: `num_tokens` tokens from `token_start` of the flat layout, at
    positions `start_position ...`; `page_ids` (and `pages`, the same as a CPU int64 tensor) are
    the pages of positions 0 .. start_position + num_tokens - 1."""

    token_start: int
    start_position: int
    num_tokens: int
    page_ids: list[int]
    pages: torch.Tensor


@dataclass(slots=True)
class StepBatch:
    """One step as every backend receives it: tokens laid out flat, the single-token decode rows
    first (row i is token i; `decode_tables[i]` its page table, `decode_context_lens[i]` its
    length including the new token), then each prefill chunk."""

    page_size: int
    positions: torch.Tensor  # [T] int64 on the device
    write_slots: torch.Tensor  # [T] int64 on the device: where each token's K/V goes
    decode_tables: list[list[int]]
    decode_context_lens: list[int]
    prefills: list[PrefillChunk]
    # The longest sequence in the step, its new tokens included (None: not given).
    longest_context: int | None = None
    # What attention with options gathers, by window, built by its first layer (`attention/windowed.py`).
    gathers: dict = field(default_factory=dict)


@dataclass(slots=True)
class StepContext:
    """What every layer needs for one forward pass besides the hidden states."""

    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T]
    attention: Any  # the backend's plan of this step (opaque to models)
    pool: KVPool
    # The step as planned: what attention with `AttentionOptions` walks (None in a replayed step).
    batch: StepBatch | None = None


@dataclass(slots=True, frozen=True)
class AttentionOptions:
    """What a layer's attention does beyond plain causal softmax attention (None: nothing).

    `window`: a query at position p sees keys at positions p - window + 1 .. p only.
    `softcap`: scores become softcap * tanh(scores / softcap) before the mask and softmax.
    `scale`: the softmax scale (None: 1/sqrt(head_dim)).
    `sinks`: one logit per query head (this rank's, `[Hq]`) that joins the softmax's denominator
    and attends to nothing (GPT-OSS's attention sinks): a query's weights sum to less than 1.
    """

    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    sinks: torch.Tensor | None = None


def options_for_step(options: AttentionOptions | None, batch: StepBatch | None) -> AttentionOptions | None:
    """The options a step's attention must follow: without a window that no sequence of the step
    outgrows (it masks no key), None where nothing else is left, so that the backend's own
    attention computes it (with options, every backend attends in PyTorch's ops, `windowed.py`;
    the compiled one computes sinks itself). Phi-3's 2,047 under 4,096 and Mistral v0.1's 4,096
    bind only past those lengths."""
    if (options is None or options.window is None or batch is None or batch.longest_context is None
            or batch.longest_context > options.window):
        return options
    if options.softcap is None and options.scale is None and options.sinks is None:
        return None
    return replace(options, window=None)


def only_sinks(options: AttentionOptions) -> bool:
    """Whether all `options` ask for is sinks (what a kernel that has them computes alone)."""
    return options.sinks is not None and options.window is None and options.softcap is None and options.scale is None


class PackedLinear(ABC):
    """A weight (and bias) in the form a backend multiplies with. `weight` is the tensor that
    holds it (the layer keeps it as its parameter: what the rank's weight memory counts);
    `extra_bytes` what it holds beyond that (a quantized weight's scales and offsets)."""

    weight: torch.Tensor
    extra_bytes: int = 0

    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[rows, K]` times the weight's transpose (+ bias) -> `[rows, N]` in x's dtype
        (or float32 where `pack` was asked for `float32_out`)."""


@dataclass(frozen=True, slots=True)
class ExpertExtras:
    """What a family's experts compute beyond SwiGLU without biases (GPT-OSS's): each expert's
    gate/up bias `[2 I]` (gate first) and down bias `[H]` (None: none; under TP the down biases
    are rank 0's alone), and the clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate) with the
    gate clamped above and up both ways at `limit` (None: plain SwiGLU)."""

    gate_up_bias: list[torch.Tensor] | None = None
    down_bias: list[torch.Tensor] | None = None
    limit: float | None = None
    alpha: float = 1.0


class PackedExperts(ABC):
    """A mixture-of-experts layer's experts packed for one call over a step's rows."""

    @abstractmethod
    def __call__(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """Rows `hidden` `[T, H]` routed to `expert_ids` `[T, top_k]` with `weights` `[T, top_k]`
        -> `[T, H]` in hidden's dtype: each row's sum over its choices of weight * the expert's
        SwiGLU MLP (this rank's partial sum under TP); None where this product does not take
        `T` rows (the caller computes them itself)."""

    @abstractmethod
    def linears(self) -> list[tuple[PackedLinear, PackedLinear]]:
        """Each expert's (gate/up, down) as linear layers over the same packed weights, for the
        steps `__call__` does not take."""


class RowKernels(Protocol):
    """Row-wise ops as one kernel each (the compiled ones, Triton's): what `row_kernels.py` calls."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rope_store(self, qkv: torch.Tensor, num_q_heads: int, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                   write_slots: torch.Tensor) -> None: ...


class FusedLayers(Protocol):
    """A model's decoder layers as compiled calls (see `Backend.fused_layers`)."""

    def applies(self, step: StepContext) -> bool: ...

    def run(self, hidden: torch.Tensor, step: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers over the embeddings `hidden`: (the last layer's MLP output, the residual
        stream), as the model's own `run_layers` returns them."""


class WholeSteps(Protocol):
    """Whole forward passes of some steps replayed (see `Backend.whole_steps`)."""

    def applies(self, entries: list[ForwardEntry]) -> bool: ...

    def run(self, entries: list[ForwardEntry]) -> torch.Tensor:
        """Float32 logits of a step that `applies`, as `ModelRunner.forward` returns them."""


# What GPT-OSS names among its ops without kernels (`CausalLM.ops_without_kernels`).
ATTENTION_SINKS = "attention sinks"


class Backend(ABC):
    """One way of running a model's step on `device` in `dtype` (see the module doc)."""

    name: ClassVar[str]  # as the worker reports it: "torch", "native", "triton"
    # Of the ops models name as without kernels, those this backend's own kernels compute.
    kernel_ops: ClassVar[tuple[str, ...]] = ()
    extra_pages: int = 0  # pages the pool holds beyond the router's (see `whole_steps`)

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype

    @abstractmethod
    def plan(self, batch: StepBatch, pool: KVPool) -> StepContext: ...

    @abstractmethod
    def pack(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None, *,
             float32_out: bool = False) -> PackedLinear:
        """`weight` `[N, K]` (loaded: plain, or quantized) and `bias` `[N]` packed for this backend. With
        `float32_out` the product may come back in float32 (logits) instead of the weight's dtype."""

    @abstractmethod
    def rope(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> Rope:
        """What `attention` takes as `rope` this step: `rotary`'s tables, whole or looked up."""

    @abstractmethod
    def attention(self, qkv: torch.Tensor, num_q_heads: int, k_slots: torch.Tensor, v_slots: torch.Tensor,
                  step: StepContext, rope: Rope, options: AttentionOptions | None = None) -> torch.Tensor:
        """Merged projections `qkv` `[T, Hq + 2 Hk, D]` (q heads, then k, then v; may be rotated
        in place) against one layer's head-major pool `[Hk, num_slots, D]` -> `[T, Hq, D]`, with
        `options` where given."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm of `residual + x`, `residual + x`), the sum rounded to the dtype as a plain add
        would be. `residual` may be updated in place: it must be the model's own running sum."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: silu(gate) * up of `[T, 2 I]` (gate first) -> `[T, I]`."""

    @abstractmethod
    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GELU (tanh approximation) gating: gelu_tanh(gate) * up of `[T, 2 I]` -> `[T, I]`."""

    def pack_experts(self, gate_up: list[torch.Tensor], down: list[torch.Tensor],
                     extras: ExpertExtras | None = None) -> PackedExperts | None:
        """Experts' gate/up `[2 I, H]` (gate features first) and down `[H, I]` weights (with
        `extras` where the family's experts have them) as one `PackedExperts`, or None (module doc)."""
        return None

    def fused_layers(self, model: torch.nn.Module, pool: KVPool) -> FusedLayers | None:
        return None

    def whole_steps(self, model: torch.nn.Module, pool: KVPool, context_len: int,
                    pad_page: int) -> WholeSteps | None:
        return None

    def new_sampler(self, seed: int | None = None) -> Sampler:
        return Sampler(self.device, seed)
