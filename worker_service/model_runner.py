"""The model runner: one rank's weights and KV pool, and one batched forward pass per step.

`ModelRunner.forward(entries)` takes the step's entries (prefill chunks starting at any position
and single decode tokens, in any mix), lays their tokens out flat (decode tokens first), builds
the page-table metadata once, runs the model, and returns on rank 0 the float32 logits of the
last `num_logits` tokens of every `sample=True` entry, in entry order. Every rank must be called with the same
entries; with world_size > 1 the caller has already joined the process group
(`distributed.init_distributed`). Entries are assumed valid (the executor checks them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from radixserve.v1 import worker_pb2
from worker_service import native
from worker_service.attention import AttentionBatch, GatherSpace, PrefillSpan, additive_mask, plan_decode
from worker_service.attention.decode_plan import shared_prefixes
from worker_service.attention.gpu_decode import plan_gpu_decode, use_triton
from worker_service.cuda_graphs import DecodeGraphs
from worker_service.distributed import TPGroup
from worker_service.dtypes import DTYPES, resolve_dtype
from worker_service.forward_batch import ForwardEntry
from worker_service.kv_pool import KVPool
from worker_service.layers.fused_layer import FusedDecode
from worker_service.layers import triton_ops
from worker_service.layers.linear import pack_linear_weights
from worker_service.layers.norm import RMSNorm
from worker_service.loader import load_weights
from worker_service.models import model_class
from worker_service.models.llama import LlamaAttention, LlamaMLP, StepContext, head_dim_of


@dataclass(slots=True, frozen=True)
class RunnerConfig:
    """What a rank runs: the checkpoint folder, where and in which dtype, and its KV budget.

    `dtype` may be `auto` (see `worker_service.dtypes`); `info.dtype` says what it resolved to.
    `kv_cache_bytes` is this rank's budget for its KV pages (K and V, all layers, its own KV
    heads); the page count follows from it. `rank` / `world_size` place it in the TP group, which
    the caller has already joined when `world_size > 1`.
    """

    model_dir: Path
    device: str = "cpu"
    dtype: str = "float32"
    page_size: int = 16
    kv_cache_bytes: int = 1 << 30
    rank: int = 0
    world_size: int = 1
    attention_kernel: str = "auto"  # see `worker_service.native.select` and `attention.gpu_decode`
    # Decode steps of up to this many rows replay CUDA graphs (`cuda_graphs.py`; 0: never). Only
    # on CUDA with the Triton decode kernel and one rank.
    cuda_graph_max_batch: int = 0


def eos_token_ids(model_dir: Path, config_eos: int | list[int] | None) -> list[int]:
    """EOS ids from config.json and generation_config.json together, first-seen order."""
    found: list[int] = []
    sources: list[int | list[int] | None] = [config_eos]
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    for source in sources:
        ids = [] if source is None else [source] if isinstance(source, int) else list(source)
        for token_id in ids:
            if token_id not in found:
                found.append(token_id)
    return found


def context_slots(pages: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """Slots of positions 0..length-1 of the sequence held in `pages` ([P] page ids)."""
    offsets = torch.arange(page_size)
    return (pages.unsqueeze(-1) * page_size + offsets).flatten()[:length]


class ModelRunner:
    """One rank's model shard and KV pool.

    Invariants: the pool's page ids are the router's (page p holds slots p * page_size ...
    (p + 1) * page_size - 1 in every layer); `forward` writes K/V only into slots named by the
    entries' page tables and reads only through them.
    """

    def __init__(self, config: RunnerConfig) -> None:
        dtype_name = resolve_dtype(config.dtype, config.device)
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[dtype_name]
        self.page_size = config.page_size
        model_dir = Path(config.model_dir)
        self.hf_config = AutoConfig.from_pretrained(model_dir)
        group = TPGroup(config.rank, config.world_size)
        with torch.inference_mode():
            self.model = model_class(self.hf_config)(self.hf_config, group, self.dtype, self.device)
        load_weights(self.model, model_dir)
        # The compiled kernels (paged attention with RoPE and the K/V write; the residual adds with
        # their norms, SwiGLU; small-batch linear layers), or None for PyTorch's ops throughout.
        # Layers that can use them have a `kernels` attribute (linear layers get theirs by `pack`).
        self.kernels = native.select(config.attention_kernel, head_dim_of(self.hf_config), self.dtype,
                                     self.device)
        # After loading: packed weights cannot be loaded into.
        pack_linear_weights(self.model, self.kernels)
        self.model.eval()
        self.use_triton = self.kernels is None and use_triton(config.attention_kernel, head_dim_of(self.hf_config),
                                                              self.dtype, self.device)
        with_graphs = self.use_triton and config.world_size == 1 and config.cuda_graph_max_batch > 0

        shape = (self.hf_config.num_hidden_layers, config.page_size, self.model.num_kv_heads,
                 head_dim_of(self.hf_config))
        num_pages = KVPool.pages_for_budget(config.kv_cache_bytes, *shape, dtype=self.dtype)
        # With graphs, one more page than the router is told of: the padding rows' (`cuda_graphs.py`).
        self.pool = KVPool(shape[0], num_pages + with_graphs, config.page_size, shape[2], shape[3],
                           self.dtype, self.device)
        self.gather_space = GatherSpace()
        self.model.fused = FusedDecode.build(self.kernels, self.model, self.pool)
        self._attach_row_ops()
        # What this rank reports (GetWorkerInfo); the executor copies it with the group's page count.
        self.info = worker_pb2.GetWorkerInfoResponse(
            model_name=model_dir.name,
            dtype=dtype_name,
            device=str(self.device),
            page_size=config.page_size,
            num_pages=num_pages,
            context_len=self.hf_config.max_position_embeddings,
            vocab_size=self.hf_config.vocab_size,
            eos_token_ids=eos_token_ids(model_dir, self.hf_config.eos_token_id),
            rank=config.rank,
            world_size=config.world_size,
        )
        self.graphs = DecodeGraphs(self, config.cuda_graph_max_batch, pad_page=num_pages) if with_graphs else None

    def _attach_row_ops(self) -> None:
        """The layers' row-wise ops as one kernel each: the compiled ones on CPU; on CUDA beside the
        Triton attention, Triton's (`layers/triton_ops.py`), RoPE with the K/V write among them."""
        if self.kernels is not None:
            row_ops = self.kernels
        elif self.use_triton:
            row_ops = triton_ops.TritonRowOps()
        else:
            return
        for module in self.model.modules():
            if isinstance(module, (RMSNorm, LlamaMLP)):
                module.kernels = row_ops
            if isinstance(module, LlamaAttention) and self.use_triton:
                module.rope_kernels = row_ops

    def weight_bytes(self) -> int:
        """Bytes of this rank's parameters (a tied embedding counted once)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.inference_mode()
    def forward(self, entries: list[ForwardEntry]) -> torch.Tensor | None:
        """One step over `entries`; float32 logits `[sum of sampled entries' num_logits, vocab]`
        on rank 0, else None."""
        if not entries:  # every rank gets the same entries, so every rank skips the collectives
            empty = torch.empty(0, self.info.vocab_size, dtype=torch.float32, device=self.device)
            return empty if self.config.rank == 0 else None
        if self.graphs is not None and self.graphs.applies(entries):
            return self.graphs.run(entries)
        token_ids, positions, attention, sample_indices = self._layout(entries)
        step = StepContext(positions=positions, attention=attention, pool=self.pool)
        logits = self.model(token_ids, step, sample_indices)
        return None if logits is None else logits.float()

    def _layout(
        self, entries: list[ForwardEntry]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, torch.Tensor]:
        """Flat token layout (decode tokens first, then each prefill chunk) and its metadata.

        Returns token ids [T], positions [T], the attention metadata, and the flat indices of
        the last `num_logits` tokens of each sampled entry (entry order). Python work is per entry, not per token.
        """
        page_size, device = self.page_size, self.device
        decode = [i for i, entry in enumerate(entries) if len(entry.token_ids) == 1]
        prefill = [i for i, entry in enumerate(entries) if len(entry.token_ids) > 1]
        token_ids: list[int] = [entries[i].token_ids[0] for i in decode]
        positions: list[int] = [entries[i].start_position for i in decode]
        last_token_index = {i: flat_index for flat_index, i in enumerate(decode)}
        write_slots: list[torch.Tensor] = [torch.tensor(
            [entries[i].slot(p, page_size) for i, p in zip(decode, positions)], dtype=torch.int64)]

        tables = [entries[i].page_table for i in decode]
        context_lens = [position + 1 for position in positions]
        native_plan = decode_plan = gpu_plan = None
        if decode and self.use_triton:
            gpu_plan = plan_gpu_decode(tables, context_lens, page_size, device)
        elif decode and self.kernels is None:
            decode_plan = plan_decode(tables, context_lens, page_size, device)

        spans: list[PrefillSpan] = []
        native_spans: list[tuple[int, int, int, list[int]]] = []
        for i in prefill:
            entry = entries[i]
            start, end = entry.start_position, entry.start_position + len(entry.token_ids)
            page_ids = entry.page_table[: (end - 1) // page_size + 1]
            pages = torch.tensor(page_ids)
            write_slots.append(context_slots(pages, end, page_size)[start:])
            if self.kernels is not None:
                native_spans.append((len(token_ids), end - start, start, page_ids))
            else:
                span_pages = span_mask = None
                if start > 0:
                    span_pages = pages.to(device)
                    key_positions = torch.arange(len(pages) * page_size).unsqueeze(0)
                    allowed = key_positions <= torch.arange(start, end).unsqueeze(1)
                    span_mask = additive_mask(allowed.to(device), self.dtype)
                spans.append(PrefillSpan(len(token_ids), len(token_ids) + end - start, span_pages, span_mask))
            token_ids.extend(entry.token_ids)
            positions.extend(range(start, end))
            last_token_index[i] = len(token_ids) - 1
        if self.kernels is not None:
            native_plan = self.kernels.plan(tables, context_lens, page_size,
                                            shared_prefixes(tables, context_lens, page_size), native_spans)

        attention = AttentionBatch(
            page_size=page_size,
            write_slots=torch.cat(write_slots).to(device),
            decode=decode_plan,
            prefills=spans,
            space=self.gather_space,
            native=native_plan,
            gpu_decode=gpu_plan,
        )
        sample_indices = [
            index
            for i, entry in enumerate(entries) if entry.sample
            for index in range(last_token_index[i] - entry.num_logits + 1, last_token_index[i] + 1)
        ]
        return (
            torch.tensor(token_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            attention,
            torch.tensor(sample_indices, dtype=torch.int64, device=device),
        )
