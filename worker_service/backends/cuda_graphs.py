"""Decode steps replayed from CUDA graphs: one captured forward pass per batch-size bucket.

A small model's decode step on a GPU is hundreds of tiny kernels, and launching them one by one
from Python costs far more than running them. A CUDA graph records a step's launches once and
replays them with one call. A graph replays fixed shapes and fixed addresses, so:

- its inputs live in static device buffers sized for the largest bucket, filled before each
  replay (token ids, positions, K/V write slots, page tables padded to the model's context, lengths);
- a step of `n` rows replays the smallest bucket `b >= n`; rows `n .. b-1` are padding: they
  decode token 0 at position 0 of a page the router never hands out (`pad_page`, one page
  beyond the router's count), so they write nowhere that matters and read one position;
- decode attention is the Triton kernel (`attention/gpu_decode.py`), whose launch depends only
  on shapes; the PyTorch backend's gathers have data-dependent shapes and cannot be captured.

Only plain decode steps replay (every entry one token, sampled, one logit row); prefill,
speculative verification and mixed steps run eagerly. Captures share one memory pool, largest
first, so the buckets together cost about one step's activations.
"""

from __future__ import annotations

import torch

from worker_service.attention import AttentionBatch
from worker_service.attention.gpu_decode import GpuDecodePlan, padded_tables, pages_of
from worker_service.backends.base import StepContext
from worker_service.forward_batch import ForwardEntry
from worker_service.kv_pool import KVPool

SMALL_BUCKETS = (1, 2, 4, 8)  # then multiples of BUCKET_STEP up to the largest batch
BUCKET_STEP = 16
WARMUP_RUNS = 2  # eager runs before a capture: Triton compiles, cuBLAS picks its kernels


def bucket_sizes(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for, ascending; the last is `max_batch`."""
    sizes = [size for size in SMALL_BUCKETS if size < max_batch]
    sizes += list(range(BUCKET_STEP, max_batch, BUCKET_STEP))
    return sorted(set(sizes)) + [max_batch]


class DecodeGraphs:
    """Captured decode steps of `model` (on the Triton backend, over `pool`) for batches of
    1 .. `max_batch` rows, positions up to `context_len`.

    Invariant: page `pad_page` of the pool is outside the router's page ids.
    """

    def __init__(self, model: torch.nn.Module, pool: KVPool, context_len: int, max_batch: int,
                 pad_page: int) -> None:
        self.model = model
        self.pool = pool
        self.page_size = pool.page_size
        self.pad_page = pad_page
        self.max_pages = pages_of(context_len, self.page_size)
        device = pool.buffer.device
        self.sizes = bucket_sizes(max_batch)
        rows = self.sizes[-1]
        # Rows 0..2 of `ints`: token ids, positions, write slots (int64), as the model reads them.
        self._ints = torch.zeros(3, rows, dtype=torch.int64, device=device)
        self._context_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self._block_tables = torch.full((rows, self.max_pages), pad_page, dtype=torch.int32, device=device)
        self._sample_indices = torch.arange(rows, device=device)
        # Pinned staging: host-to-device copies of the inputs without a pageable bounce.
        self._host_ints = torch.zeros(3, rows, dtype=torch.int64, pin_memory=True)
        self._host_lens = torch.ones(rows, dtype=torch.int32, pin_memory=True)
        # A padding row's token, position and write slot (a column of `_host_ints`).
        self._padding = torch.tensor([[0], [0], [pad_page * self.page_size]])
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture()

    def _forward(self, batch: int) -> torch.Tensor:
        """The eager forward pass over the first `batch` rows of the static buffers."""
        write_slots = self._ints[2, :batch]
        decode = GpuDecodePlan(self._block_tables[:batch], self._context_lens[:batch], self.page_size)
        attention = AttentionBatch(page_size=self.page_size, write_slots=write_slots, decode=decode, prefills=[])
        step = StepContext(positions=self._ints[1, :batch], write_slots=write_slots, attention=attention,
                           pool=self.pool)
        return self.model(self._ints[0, :batch], step, self._sample_indices[:batch]).float()

    def _capture(self) -> None:
        self._ints[2].fill_(self.pad_page * self.page_size)  # every row padding while capturing
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for batch in reversed(self.sizes):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self._forward(batch)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(batch)
            self._graphs[batch] = (graph, logits)
        torch.cuda.synchronize()

    def applies(self, entries: list[ForwardEntry]) -> bool:
        """Whether `entries` form a step a graph replays (see the module doc)."""
        limit = self.max_pages * self.page_size
        return 0 < len(entries) <= self.sizes[-1] and all(
            len(entry.token_ids) == 1 and entry.sample and entry.num_logits == 1
            and entry.start_position < limit
            for entry in entries
        )

    def run(self, entries: list[ForwardEntry]) -> torch.Tensor:
        """Float32 logits `[len(entries), vocab]` of a step that `applies`."""
        num_rows = len(entries)
        batch = next(size for size in self.sizes if size >= num_rows)
        page_size, pad = self.page_size, self.pad_page
        host = self._host_ints
        host[:, num_rows:batch] = self._padding
        host[:, :num_rows] = torch.tensor([
            [entry.token_ids[0] for entry in entries],
            [entry.start_position for entry in entries],
            [entry.slot(entry.start_position, page_size) for entry in entries],
        ])
        lens = [entry.start_position + 1 for entry in entries]
        tables = padded_tables([entry.page_table for entry in entries], lens, page_size, pad)
        self._host_lens[:num_rows] = torch.tensor(lens, dtype=torch.int32)
        self._host_lens[num_rows:batch] = 1
        self._ints[:, :batch].copy_(host[:, :batch])
        self._context_lens[:batch].copy_(self._host_lens[:batch])
        # Only the columns a row reads need to be current; the padding rows keep `pad_page`.
        self._block_tables[:num_rows, :tables.shape[1]].copy_(tables)
        self._block_tables[num_rows:batch, 0] = pad
        graph, logits = self._graphs[batch]
        graph.replay()
        return logits[:num_rows].clone()
