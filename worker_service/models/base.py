"""What every model class is to the runner: a causal LM over one TP rank, built on a backend.

A model is constructed with the worker's backend (`worker_service.backends`) and calls it for
attention, the row-wise ops and (through its layers' packed weights) the linear layers; it never
asks which backend it is. Its forward pass is three parts the runner may call separately:
`embed`, `run_layers` and `logits`. Where the backend has a whole-layer fused path for the
model's layer, the runner replaces `run_layers` by it; a model takes such a path only by
declaring `fusable_layer`, the kind of decoder layer it has (e.g. `"llama"`), and must declare
it only where its layers compute exactly that layer. The default, None, never fuses.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from worker_service.backends.base import StepContext


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class CausalLM(torch.nn.Module):
    fusable_layer: ClassVar[str | None] = None
    # Whether attention's values are its keys (DeepSeek's latent row): the pool then holds one copy.
    values_are_keys: ClassVar[bool] = False

    @classmethod
    def kv_cache_geometry(cls, config: Any) -> tuple[int, int]:
        """(KV heads at TP=1, head dim) of a token's cached keys and values in each layer: the
        pool's shape and the head dim the backend's attention takes (DeepSeek's latent differs)."""
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads, head_dim_of(config)

    @classmethod
    def ops_without_kernels(cls, config: Any) -> tuple[str, ...]:
        """What this model with `config` asks of the backend that only PyTorch's ops compute
        (e.g. "sliding-window attention"), named for the backend selection's reason; default none."""
        return ()

    def fused_applies(self, step: StepContext) -> bool:
        """Whether the backend's fused layers (`fusable_layer`) compute this step as the model's
        own layers would: always, but for a windowed model's step that a sequence outgrows the
        window of (the fused layer has no window)."""
        return True

    def after_load(self) -> None:
        """What the model does to its weights once they are read, before the backend packs them
        (Llama's family: q and k rows in a partial rotation's order); default nothing."""

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states `[T, hidden]` of the step's tokens."""
        raise NotImplementedError

    def run_layers(self, hidden: torch.Tensor, step: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer over the embeddings: (the last layer's output, the residual stream
        before it; their sum is the final hidden state)."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor, residual: torch.Tensor, sample_indices: torch.Tensor) -> torch.Tensor | None:
        """Logits `[len(sample_indices), vocab]` of the chosen tokens, on rank 0 (None elsewhere)."""
        raise NotImplementedError

    def final_hidden(self, hidden: torch.Tensor, residual: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The final hidden states `[len(indices), hidden]` (after the model's last norm: what
        transformers' base model returns as `last_hidden_state`) of the chosen tokens. Local to
        the rank (no collective): every rank holds the whole hidden state. The default is for
        models whose last norm is `self.norm` over the residual sum."""
        return self.norm((hidden + residual).index_select(0, indices))

    def forward(self, token_ids: torch.Tensor, step: StepContext, sample_indices: torch.Tensor) -> torch.Tensor | None:
        hidden, residual = self.run_layers(self.embed(token_ids), step)
        return self.logits(hidden, residual, sample_indices)
