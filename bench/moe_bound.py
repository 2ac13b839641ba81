"""What one step of a mixture-of-experts model reads and computes, for `bench_worker`'s bounds.

A dense step reads every weight once; an MoE step reads the weights outside the experts and only
the experts its tokens were routed to (distinct experts per layer), and each token multiplies
only its `top_k` experts. `routed_shape` counts the routed experts from the router's choices on
one step of the bench's own sequences (the step after the timed ones: the same kind of step), and
`active_shape` gives the per-token products for the compute side (prefill).

`make_random_moe` is `bench_worker --model random-moe`: a random Qwen3-MoE saved with
transformers' own classes, hidden 512, 16 experts of 512, top-2, 4 layers, 8 / 2 heads of 64,
vocab 8192 — tiny but not trivial: its experts are most of its bytes, and at batch 32 most of
them are routed to.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from bench.bounds import StepShape
from worker_service.models.moe import SparseMoE

RANDOM_MOE = "random-moe"


def make_random_moe(out_dir: Path, hidden_size: int = 512) -> Path:
    """The checkpoint above; a smaller `hidden_size` (experts as wide as it) keeps its
    routing and step structure with products too small to cost (`bench_expert_product`)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=8192, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                            moe_intermediate_size=hidden_size,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                            num_experts=16, num_experts_per_tok=2, norm_topk_prob=True,
                            max_position_embeddings=4096, tie_word_embeddings=False)
    Qwen3MoeForCausalLM(config).eval().save_pretrained(out_dir)
    return out_dir


def moe_blocks(model: torch.nn.Module) -> list[SparseMoE]:
    return [module for module in model.modules() if isinstance(module, SparseMoE)]


def _linears(block: SparseMoE, expert: int) -> list[torch.nn.Module]:
    return [block.gate_up[expert], block.down[expert]]


def _bytes(linear: torch.nn.Module) -> int:
    """This rank's bytes of one linear layer, with what its packed weight holds beside it."""
    packed = getattr(linear, "packed", None)
    extra = packed.extra_bytes if packed is not None else 0
    return extra + sum(p.numel() * p.element_size() for p in linear.parameters())


def _params(linear: torch.nn.Module) -> int:
    """Multiply-adds per token of one linear layer (a quantized weight's parameter holds packed values)."""
    quantized = getattr(getattr(linear, "packed", None), "quantized", None)
    if quantized is not None:
        return quantized.out_features * quantized.in_features
    return sum(p.numel() for p in linear.parameters())


def expert_bytes(block: SparseMoE) -> int:
    """Bytes of one expert's three projections (this rank's share; every expert is the same size)."""
    return sum(_bytes(linear) for linear in _linears(block, 0))


def active_shape(shape: StepShape, blocks: list[SparseMoE]) -> StepShape:
    """`shape` with each token multiplying only its `top_k` experts (weight bytes unchanged)."""
    each = sum(_params(linear) for linear in _linears(blocks[0], 0))
    idle = sum((block.routing.num_experts - block.routing.top_k) * each for block in blocks)
    return dataclasses.replace(shape, matmul_params=shape.matmul_params - idle)


class RoutedExperts:
    """Counts the distinct experts each MoE layer is routed to, per forward pass, while installed."""

    def __init__(self, blocks: list[SparseMoE]) -> None:
        self.counts: list[int] = []
        self.handles = [block.register_forward_pre_hook(self._count) for block in blocks]

    def _count(self, block: SparseMoE, inputs: tuple[torch.Tensor]) -> None:
        self.counts.append(int(block.route(inputs[0])[1].unique().numel()))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@dataclasses.dataclass(frozen=True)
class RoutedStep:
    shape: StepShape  # weight bytes: outside the experts plus the experts routed to
    num_routed: int  # layer-experts routed to, summed over the MoE layers
    num_experts: int  # layer-experts in all


def routed_shape(shape: StepShape, blocks: list[SparseMoE], runner, entries: list) -> RoutedStep:
    """`active_shape(shape)` reading only the experts that one step over `entries` (run here, at
    the sequences' current position, which the next step rewrites) is routed to."""
    counter = RoutedExperts(blocks)
    try:
        runner.forward(entries)
    finally:
        counter.remove()
    if len(counter.counts) != len(blocks):  # a step replayed from a CUDA graph runs no Python hooks
        raise RuntimeError(f"counted {len(counter.counts)} of {len(blocks)} MoE layers' routing on one step: "
                           "measure MoE checkpoints without CUDA graphs (--cuda-graph-max-batch 0)")
    each = expert_bytes(blocks[0])
    num_experts = sum(block.routing.num_experts for block in blocks)
    routed = sum(counter.counts)
    weight_bytes = shape.weight_bytes - (num_experts - routed) * each
    return RoutedStep(dataclasses.replace(active_shape(shape, blocks), weight_bytes=weight_bytes), routed,
                      num_experts)
