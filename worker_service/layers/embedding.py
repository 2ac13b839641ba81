"""Vocabulary-parallel embedding and LM head.

Each rank holds a contiguous range of vocabulary rows. The embedding looks up the ids it owns,
leaves zeros for the rest, and the group sums; the LM head computes logits for its own range and
rank 0 gathers the full row. With tied embeddings both use one parameter, except that on CPU the LM
head keeps a oneDNN-packed copy (`pack`, any dtype `can_pack` accepts): one decode token's LM head
is then 2.5-5x faster, for 1/vocab_shards of the embedding's bytes more memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from worker_service.distributed import TPGroup, all_reduce_sum, gather_last_dim
from worker_service.layers.linear import GEMV_MAX_ROWS, can_pack, widens_to_float32
from worker_service.layers.sharding import balanced_range
from worker_service.layers.weights import WeightSlice, make_param

if TYPE_CHECKING:
    from worker_service.native import GemvWeight, NativeKernels


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

    # Set by `pack` where the packed kernel is faster (a plain tensor beside the weight, which
    # the tied embedding still reads); the plain weight is used until then.
    packed_weight: torch.Tensor | None = None
    gemv: GemvWeight | None = None  # the small-batch kernel's copy (`layers/linear.py`)
    kernels: NativeKernels | None = None

    # Float16 without a float16 GEMM: products beyond the small-batch kernel's in float32
    # (layers/linear.py), by the packed copy, or by this widened weight where none packs.
    in_float32 = False
    float32_weight: torch.Tensor | None = None

    def pack(self, kernels: NativeKernels | None = None) -> None:
        """Use a oneDNN-packed copy of the (loaded) weight where that is faster (see module doc),
        and with `kernels` the small-batch kernel's copy where it runs."""
        weight = self.weight.detach()
        if kernels is not None and self.gemv is None:
            self.gemv = kernels.pack_gemv(weight)
            self.kernels = kernels if self.gemv is not None else None
        if widens_to_float32(weight):
            weight = weight.float()
            self.in_float32 = True
        if self.packed_weight is None and can_pack(weight):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            self.packed_weight = packed
        if self.in_float32 and self.packed_weight is None:
            self.float32_weight = weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.gemv is not None and hidden.shape[0] <= GEMV_MAX_ROWS:
            return gather_last_dim(self.kernels.gemv(hidden, self.gemv), self.shard_sizes, self.group)
        if self.in_float32:
            hidden = hidden.float()  # logits are float32 from here on anyway
        if self.packed_weight is not None:
            logits = torch.ops.mkldnn._linear_pointwise(hidden, self.packed_weight, None, "none", [], "")
        else:
            logits = F.linear(hidden, self.float32_weight if self.in_float32 else self.weight)
        return gather_last_dim(logits, self.shard_sizes, self.group)
