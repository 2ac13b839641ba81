"""Vocabulary-parallel embedding and LM head.

Each rank holds a contiguous range of vocabulary rows. The embedding looks up the ids it owns,
leaves zeros for the rest, and the group sums; the LM head computes logits for its own range and
rank 0 gathers the full row. With tied embeddings both use one parameter; the LM head multiplies
with the backend's packed form of it (`pack`), kept beside the plain weight that the embedding
still reads: on CPU that packed copy makes a decode token's LM head several times faster, for
1/vocab_shards of the embedding's bytes more memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_service.backends.base import Backend, PackedLinear
from worker_service.distributed import TPGroup, all_reduce_sum, gather_last_dim
from worker_service.layers.sharding import balanced_range
from worker_service.layers.weights import WeightSlice, make_param
from worker_service.quant.scheme import Quantizer


class VocabShard(torch.nn.Module):
    """This rank's contiguous range of vocabulary rows of a `[vocab, hidden]` matrix: the
    embedding table, or the LM head (which `tied_to` an embedding shares its weight)."""

    def __init__(
        self, name: str, vocab_size: int, hidden_size: int, group: TPGroup,
        dtype: torch.dtype, device: torch.device, tied_to: VocabShard | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.vocab_range = balanced_range(vocab_size, group.world_size, group.rank)
        # Every rank's row count, in rank order: how rank 0 reassembles a full logits row.
        self.shard_sizes = [len(balanced_range(vocab_size, group.world_size, r))
                            for r in range(group.world_size)]
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = make_param(
                (len(self.vocab_range), hidden_size), [WeightSlice(name, self.vocab_range)], dtype,
                device,
            )


class VocabParallelEmbedding(VocabShard):
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return F.embedding(token_ids, self.weight)
        local_ids = token_ids - self.vocab_range.start
        outside = (local_ids < 0) | (local_ids >= len(self.vocab_range))
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce_sum(hidden, self.group)


class ParallelLMHead(VocabShard):
    """Logits over the full vocabulary, assembled on rank 0 only (None elsewhere)."""

    packed: PackedLinear | None = None  # set by `pack`, beside the plain weight
    copy_bytes: int = 0  # what a quantized copy holds beside the plain weight (its values)

    def pack(self, backend: Backend, quantize: Quantizer | None = None) -> None:
        """Multiply with `backend`'s packed copy of the (loaded) weight, quantized by `quantize`
        where given, from now on (the plain weight stays: a tied embedding reads it); logits may
        come back in float32 where the backend widens the product."""
        if self.packed is None:
            weight = self.weight.detach()
            if quantize is None:
                self.packed = backend.pack(weight, None, float32_out=True)
                return
            quantized = quantize(weight)
            self.packed = backend.pack(quantized, None, float32_out=True)
            self.copy_bytes = quantized.values.numel() * quantized.values.element_size()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return gather_last_dim(self.packed(hidden), self.shard_sizes, self.group)
