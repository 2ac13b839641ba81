"""Models whose layers do not all rotate alike: by their layer type's RoPE tables
(`config.layer_types`, with `rope_parameters` keyed by type or one set for all: Gemma 2/3 and
OLMo 3), some not at all ("NoPE" layers: SmolLM3's, EXAONE 4's full layers), or by the model's own
rotation rather than the backend's (DeepSeek's latent attention, Hunyuan's norms after RoPE)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, NamedTuple

import torch

from worker_service.backends.base import Rope, StepContext
from worker_service.layers.rotary import RotaryEmbedding, rope_parameters_by_layer_type, served_context
from worker_service.models.llama import head_dim_of


def rotaries_by_layer_type(config: Any, dtype: torch.dtype, device: torch.device) -> torch.nn.ModuleDict:
    """One `RotaryEmbedding` per layer type, over the model's context."""
    return torch.nn.ModuleDict(
        (kind, RotaryEmbedding(SimpleNamespace(rope_parameters=params,
                                               max_position_embeddings=config.max_position_embeddings),
                               head_dim_of(config), config.max_position_embeddings, dtype, device))
        for kind, params in rope_parameters_by_layer_type(config).items())


class RotatesByLayerType:
    """`run_layers` for a model whose `layers` each have a `layer_type` and whose `rotaries` hold
    each type's tables (`rotaries_by_layer_type`)."""

    def run_layers(self, hidden: torch.Tensor, step: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        ropes = {kind: self.backend.rope(rotary, step.positions) for kind, rotary in self.rotaries.items()}
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, step, ropes[layer.layer_type])
        return hidden, residual


def unrotated_table(config: Any, dtype: torch.dtype, device: torch.device, head_dim: int | None = None
                    ) -> RotaryEmbedding:
    """Tables that rotate nothing (cos 1, sin 0: a rotation by them returns its input exactly), over
    the model's heads or `head_dim` dims, for the positions the model serves."""
    return RotaryEmbedding(config, head_dim or head_dim_of(config), served_context(config), dtype, device,
                           rotate=False)


class SkipsRopeInSomeLayers:
    """`run_layers` for a model whose layers rotate where `uses_rope[i]` and otherwise take
    `unrotated`'s table (`unrotated_table`, so the backends need nothing of their own); `rotary`
    is the table of the others. `rotate_only` sets both."""

    def rotate_only(self, uses_rope: list[bool], config: Any, dtype: torch.dtype, device: torch.device) -> None:
        self.uses_rope = uses_rope
        self.unrotated = unrotated_table(config, dtype, device)

    def run_layers(self, hidden: torch.Tensor, step: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        rope = self.backend.rope(self.rotary, step.positions)
        no_rope = self.backend.rope(self.unrotated, step.positions) if not all(self.uses_rope) else rope
        residual = None
        for layer, uses_rope in zip(self.layers, self.uses_rope):
            hidden, residual = layer(hidden, residual, step, rope if uses_rope else no_rope)
        return hidden, residual


class SelfRotatedRope(NamedTuple):
    """A step's rope for layers that rotate q and k themselves: the backend's tables (unrotated:
    cos 1, sin 0, so its rotation returns its input exactly) and the model's cos/signed sin at the
    step's positions (`RotaryEmbedding.lookup`)."""

    backend: Rope
    cos: torch.Tensor
    sin: torch.Tensor


class RotatesItself:
    """`run_layers` for a model whose layers rotate q and k themselves (`SelfRotatedRope`):
    `rotary` is its rotation's tables, `unrotated` the backend's."""

    def run_layers(self, hidden: torch.Tensor, step: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary.lookup(step.positions)
        rope = SelfRotatedRope(self.backend.rope(self.unrotated, step.positions), cos, sin)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, step, rope)
        return hidden, residual
