"""Vocabulary-parallel embedding and LM head.

Each rank holds a contiguous range of vocabulary rows. The embedding looks up the ids it owns,
leaves zeros for the rest, and the group sums; the LM head computes logits for its own range and
rank 0 gathers the full row. With tied embeddings both use one parameter; the LM head multiplies
with the backend's packed form of it (`pack`), kept beside the plain weight that the embedding
still reads: on CPU that packed copy makes a decode token's LM head several times faster, for
1/vocab_shards of the embedding's bytes more memory.

Where the checkpoint holds the LM head already quantized (a GGUF file's Q8_0 or Q6_K
`token_embd` / `output`), the loader hands it over as it is (`checkpoint_quantized`) and the head
multiplies with those values: the weights the plain (dequantized) copy holds exactly, in under a
third of float32's bytes. A tied head keeps the plain weight for the embedding's lookups; an
untied one holds only the quantized values.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from worker_service.backends.base import Backend, PackedLinear
from worker_service.backends.linear_quant import pack_row_blocks
from worker_service.distributed import TPGroup, all_reduce_sum, gather_last_dim
from worker_service.layers.sharding import balanced_range
from worker_service.layers.weights import WeightSlice, make_param
from worker_service.quant.format import QuantizedWeight
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
        # Whether the weight is another shard's (an embedding's, which reads it as it is).
        self.tied = tied_to is not None
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
    # Set by a loader that read the head already quantized (`gguf_loader.py`): its consecutive
    # row blocks, packed as they are in place of the plain weight (module doc).
    checkpoint_quantized: list[QuantizedWeight] | None = None

    def pack(self, backend: Backend, quantize: Quantizer | None = None) -> None:
        """Multiply with `backend`'s packed copy of the (loaded) weight from now on: the
        checkpoint's quantized one where the loader set it, else the plain one quantized by
        `quantize` where given. The plain weight stays where the head is tied (the embedding
        reads it); logits may come back in float32 where the backend widens the product."""
        if self.packed is not None:
            return
        weight = self.weight.detach()
        if self.checkpoint_quantized is not None:
            self._pack_checkpoint_quantized(backend, weight.device)
        elif quantize is None:
            self.packed = backend.pack(weight, None, float32_out=True)
        else:
            quantized = quantize(weight)
            self.packed = backend.pack(quantized, None, float32_out=True)
            self.copy_bytes = quantized.values.numel() * quantized.values.element_size()

    def _pack_checkpoint_quantized(self, backend: Backend, device: torch.device) -> None:
        # A loader reads them on the CPU; the plain weight was made on the model's device.
        blocks = [block.to(device) for block in self.checkpoint_quantized]
        self.packed = pack_row_blocks(partial(backend.pack, float32_out=True), blocks, None)
        self.checkpoint_quantized = None
        if self.tied:
            self.copy_bytes = sum(block.values.nbytes for block in blocks)
        else:  # nothing reads the plain weight (which the loader left unread): the values stand for it
            self.weight = torch.nn.Parameter(self.packed.weight, requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return gather_last_dim(self.packed(hidden), self.shard_sizes, self.group)
