"""A mixture-of-experts layer's experts as one compiled call: what `Backend.pack_experts` returns
where the grouped-expert kernel (`native/moe_kernels.py`) builds and was chosen
(`selection.select_experts`).

`CompiledExperts` holds a layer's experts stacked once at load in the layout the kernel reads
(`gate_up` `[E, 2 I, H]`, `down` `[E, H, I]`, this rank's intermediate slice `I`) and computes
steps of up to `max_rows` rows in one call, while the kernel's passes over each expert's weights
cost less than the per-expert products' work around them (`passes_allowed`); other steps are left
to the layer's own products per expert (the call returns None), which multiply views of the same
stacked weights (`linears()`), so the experts are held once.

The kernel takes an expert's weights once per tile of its rows (`MoEKernels.rows_per_pass`: 4, or
8 for bfloat16 weights where AVX-512 BF16 is): up to that it beats the per-expert products, whose
Python, dispatch, gathers and scatters cost about as much as `AROUND_MULTIPLY_ADDS` of the
kernel's own per expert; past it each further pass multiplies every weight again, where oneDNN's
blocked products grow far slower with the rows. So a step takes the call while its expected rows
per routed expert need at most 1 + AROUND_MULTIPLY_ADDS / (an expert's weights x the rows of a
pass) passes: many for small experts, one or two for DeepSeek's (docs/models.md has the
measurements).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_service.backends.base import ExpertExtras, PackedExperts, PackedLinear
from worker_service.native.moe_kernels import WEIGHT_DTYPES, MoEKernels

# Steps of at most this many rows may take the compiled call (docs/models.md has the measurement).
COMPILED_MAX_ROWS = 128
AROUND_MULTIPLY_ADDS = 40 << 20  # the per-expert products' work around them, in the kernel's (module doc)


def passes_allowed(expert_weights: int, rows_per_pass: int) -> float:
    """The passes over an expert's weights for which the compiled call still pays (module doc)."""
    return 1 + AROUND_MULTIPLY_ADDS / (expert_weights * rows_per_pass)


class ExpertSlice(PackedLinear):
    """x @ weight.T (+ bias) of one expert's weight, a view of the stacked experts (plain layout)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _stacked(biases: list[torch.Tensor] | None) -> torch.Tensor | None:
    return None if biases is None else torch.stack(biases).float().contiguous()


class CompiledExperts(PackedExperts):
    """One layer's experts for the compiled grouped product (module doc), with `extras` (GPT-OSS's
    biases and clamped SwiGLU) where given."""

    def __init__(self, kernels: MoEKernels, gate_up: list[torch.Tensor], down: list[torch.Tensor],
                 max_rows: int, extras: ExpertExtras | None = None) -> None:
        self._kernels = kernels
        self.gate_up = torch.stack(gate_up).contiguous()
        self.down = torch.stack(down).contiguous()
        self.max_rows = max_rows
        self.extras = extras or ExpertExtras()
        self._gate_up_bias, self._down_bias = _stacked(self.extras.gate_up_bias), _stacked(self.extras.down_bias)
        rows_per_pass = kernels.rows_per_pass(self.gate_up.dtype)
        expert_weights = self.gate_up[0].numel() + self.down[0].numel()
        self.max_rows_per_expert = rows_per_pass * int(passes_allowed(expert_weights, rows_per_pass))

    def takes(self, rows: int, top_k: int) -> bool:
        """Whether a step of `rows` rows, `top_k` experts each, takes the compiled call (module doc):
        the rows an expert gets if the step's (row, expert) pairs spread over as many experts as
        they can."""
        pairs = rows * top_k
        return rows <= self.max_rows and pairs <= self.max_rows_per_expert * min(pairs, self.gate_up.shape[0])

    def __call__(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        if not self.takes(hidden.shape[0], expert_ids.shape[1]):
            return None
        clamp = 0.0 if self.extras.limit is None else self.extras.limit
        return self._kernels.experts(hidden, expert_ids, weights, self.gate_up, self.down, self._gate_up_bias,
                                     self._down_bias, clamp, self.extras.alpha).to(hidden.dtype)

    def linears(self) -> list[tuple[PackedLinear, PackedLinear]]:
        """Views of the stacked weights, each with its expert's bias as the family gave it."""
        gate_up_bias, down_bias = self.extras.gate_up_bias, self.extras.down_bias
        return [(ExpertSlice(self.gate_up[e], None if gate_up_bias is None else gate_up_bias[e]),
                 ExpertSlice(self.down[e], None if down_bias is None else down_bias[e]))
                for e in range(self.gate_up.shape[0])]


@dataclass(frozen=True, slots=True)
class ExpertProducts:
    """How this worker computes MoE experts: by `kernels` where given, else each layer's own
    per-expert products (`pack` returns None)."""

    kernels: MoEKernels | None = None
    max_rows: int = COMPILED_MAX_ROWS

    def pack(self, gate_up: list[torch.Tensor], down: list[torch.Tensor],
             extras: ExpertExtras | None = None) -> CompiledExperts | None:
        weight = gate_up[0]
        if self.kernels is None or weight.device.type != "cpu" or weight.dtype not in WEIGHT_DTYPES:
            return None
        return CompiledExperts(self.kernels, gate_up, down, self.max_rows, extras)

    @property
    def description(self) -> str:
        if self.kernels is None:
            return "MoE experts by per-expert products"
        return f"MoE experts by the compiled grouped product (AVX2, up to {self.max_rows} rows)"
