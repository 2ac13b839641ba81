"""The model runner: one rank's weights and KV pool, and one batched forward pass per step.

`ModelRunner.forward(entries)` takes the step's entries (prefill chunks starting at any position
and single decode tokens, in any mix), lays their tokens out flat (decode tokens first), has the
backend plan the step once, runs the model, and returns on rank 0 the float32 logits of the
last `num_logits` tokens of every `sample=True` entry, in entry order. Every rank must be called
with the same entries; with world_size > 1 the caller has already joined the process group
(`distributed.init_distributed`). Entries are assumed valid (the executor checks them).

The backend (`worker_service.backends`) is chosen once, here, by `select_backend`; the model is
built on it. The runner alone decides which of the backend's fast paths a step takes: whole
steps replayed (CUDA graphs) where they apply, else the fused decoder layers where the backend
has them for the model's declared layer and the step fits, else the model's own layers.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.model_source import ModelSource, load_config, resolve_model
from radixserve.v1 import worker_pb2
from worker_service.backends import StepBatch, select_backend
from worker_service.backends.base import PrefillChunk
from worker_service.distributed import TPGroup
from worker_service.dtypes import DTYPES, resolve_dtype
from worker_service.forward_batch import ForwardEntry, StepOutput
from worker_service.gguf_loader import GGUFTensors, load_gguf_weights
from worker_service.gguf_config import complete_config
from worker_service.kv_pool import KVPool
from worker_service.layers.linear import pack_linear_weights
from worker_service.layers.rotary import served_context
from worker_service.loader import load_weights
from worker_service.prequantized_loader import load_prequantized_weights
from worker_service.quant.prequantized import prequantized_scheme
from worker_service.quant.scheme import quantizer, served_name
from worker_service.models import model_class

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class RunnerConfig:
    """What a rank runs: the checkpoint (a folder, or a GGUF file: `radixserve.model_source`),
    where and in which dtype, and its KV budget.

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
    attention_kernel: str = "auto"  # which backend: see `worker_service.backends.selection`
    # Decode steps of up to this many rows replay CUDA graphs (`cuda_graphs.py`; 0: never). Only
    # on CUDA with the Triton decode kernel and one rank.
    cuda_graph_max_batch: int = 0
    # Load-time quantization of the decoder layers' linear weights (`worker_service.quant.scheme`).
    quantization: str = "none"
    quantization_group_size: int = 32
    # The LM head's own int8 copy (`--lm-head-quantization`); only beside quantized decoder weights.
    lm_head_quantization: str = "none"
    # Activations of the compiled quantized products rounded to int8 (`--activation-quantization`;
    # auto: for a GGUF file's weights where the compiled kernels run, selection.py).
    activation_quantization: str = "auto"
    # Batch- and cache-invariant numerics (`worker_service.backends.invariant_backend`).
    deterministic: bool = False


def eos_token_ids(source: ModelSource, config_eos: int | list[int] | None) -> list[int]:
    """EOS ids from the config and a Hugging Face folder's generation_config.json together,
    first-seen order."""
    found: list[int] = []
    sources: list[int | list[int] | None] = [config_eos]
    generation_config = source.folder / "generation_config.json"
    if source.gguf_file is None and generation_config.is_file():
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
        source = resolve_model(config.model_dir)
        self.hf_config = load_config(source)
        gguf_path = source.gguf_path
        gguf_tensors = None if gguf_path is None else GGUFTensors(gguf_path, self.hf_config)
        if gguf_tensors is not None:  # what transformers' reading of the file leaves out (gguf_config.py)
            complete_config(gguf_tensors.reader, gguf_tensors.architecture, self.hf_config)
        # A GPTQ/AWQ checkpoint (`quantization_config`); an unsupported one is refused here.
        prequantized = None if gguf_path is not None else prequantized_scheme(self.hf_config)
        group = TPGroup(config.rank, config.world_size)
        head_dim = model_class(self.hf_config).kv_cache_geometry(self.hf_config)[1]
        quantized = ("gguf" if gguf_path is not None else
                     prequantized.method if prequantized is not None else config.quantization)
        if config.lm_head_quantization != "none" and quantized == "none":
            raise ValueError(f"--lm-head-quantization {config.lm_head_quantization} needs quantized decoder "
                             "weights (--quantization int8 or int4, a GGUF file, or a GPTQ/AWQ checkpoint)")
        if config.activation_quantization not in ("none", "auto") and quantized == "none":
            raise ValueError(f"--activation-quantization {config.activation_quantization} needs quantized decoder "
                             "weights (--quantization int8 or int4, a GGUF file, or a GPTQ/AWQ checkpoint)")
        selection = select_backend(config.attention_kernel, self.device, self.dtype, head_dim,
                                   config.world_size, config.cuda_graph_max_batch,
                                   model_class(self.hf_config).ops_without_kernels(self.hf_config),
                                   quantized, config.deterministic, config.activation_quantization)
        self.backend, self.backend_reason = selection.backend, selection.reason
        self.int8_activations = selection.int8_activations
        log.info("rank %d runs the %s backend: %s", config.rank, self.backend.name, self.backend_reason)
        with torch.inference_mode():
            self.model = model_class(self.hf_config)(self.hf_config, group, self.dtype, self.device, self.backend)
        quantization = served_name(config.quantization, config.quantization_group_size)
        if gguf_path is not None:
            # The file's quantized linear weights are kept; `--quantization` applies to its plain ones.
            # Its quantized LM head too, unless `--lm-head-quantization` asks for a copy of its own.
            kept = load_gguf_weights(self.model, gguf_tensors, keep_head=config.lm_head_quantization == "none")
            quantization = kept if config.quantization == "none" else f"{kept}+{quantization}"
        elif prequantized is not None:
            # As for GGUF: the checkpoint's int4 layers are kept, `--quantization` applies to its plain ones.
            kept = load_prequantized_weights(self.model, source.folder, prequantized)
            quantization = kept if config.quantization == "none" else f"{kept}+{quantization}"
        else:
            load_weights(self.model, source.folder)
        with torch.inference_mode():  # its tensors are the model's: inference tensors, as the loader's are
            self.model.after_load()
        # After loading: packed weights cannot be loaded into.
        pack_linear_weights(self.model, self.backend,
                            quantizer(config.quantization, config.quantization_group_size),
                            quantizer(config.lm_head_quantization))
        if config.lm_head_quantization != "none":
            quantization += f"+lm_head:{config.lm_head_quantization}"
        if self.int8_activations and quantization != "gguf:none":  # a file of plain weights has no quantized product
            quantization += "+activations:int8"
        self.model.eval()

        shape = (self.hf_config.num_hidden_layers, config.page_size, self.model.num_kv_heads, head_dim)
        shared = self.model.values_are_keys
        num_pages = KVPool.pages_for_budget(config.kv_cache_bytes, *shape, dtype=self.dtype, values_are_keys=shared)
        # The backend's fast paths may keep pages of their own beyond the router's (`extra_pages`).
        self.pool = KVPool(shape[0], num_pages + self.backend.extra_pages, config.page_size, shape[2], shape[3],
                           self.dtype, self.device, values_are_keys=shared)
        self.fused = self.backend.fused_layers(self.model, self.pool)
        context_len = served_context(self.hf_config)
        if context_len < self.hf_config.max_position_embeddings:
            log.info("rank %d serves %d tokens of the model's %d: its longrope RoPE is followed within its "
                     "original context only (docs/models.md)", config.rank, context_len,
                     self.hf_config.max_position_embeddings)
        # What this rank reports (GetWorkerInfo); the executor copies it with the group's page count.
        self.info = worker_pb2.GetWorkerInfoResponse(
            model_name=source.name,
            dtype=dtype_name,
            device=str(self.device),
            page_size=config.page_size,
            num_pages=num_pages,
            context_len=context_len,
            vocab_size=self.hf_config.vocab_size,
            eos_token_ids=eos_token_ids(source, self.hf_config.eos_token_id),
            rank=config.rank,
            world_size=config.world_size,
            quantization=quantization,
        )
        # After the pool: whole steps (CUDA graphs) capture its addresses; page `num_pages` is theirs.
        self.graphs = self.backend.whole_steps(self.model, self.pool, self.info.context_len, pad_page=num_pages)

    def weight_bytes(self) -> int:
        """Bytes of this rank's parameters (a tied embedding counted once), with what packed
        weights hold beside them (`PackedLinear.extra_bytes`: quantized weights' scales; the LM
        head's int8 copy, `ParallelLMHead.copy_bytes`)."""
        extra = sum(module.packed.extra_bytes + getattr(module, "copy_bytes", 0) for module in self.model.modules()
                    if getattr(module, "packed", None) is not None)
        return extra + sum(p.numel() * p.element_size() for p in self.model.parameters())

    def forward(self, entries: list[ForwardEntry]) -> torch.Tensor | None:
        """One step over `entries`; float32 logits `[sum of sampled entries' num_logits, vocab]`
        on rank 0, else None."""
        return self.forward_step(entries).logits

    @torch.inference_mode()
    def forward_step(self, entries: list[ForwardEntry]) -> StepOutput:
        """`forward`, with the pooled rows of embedding entries (see `StepOutput`)."""
        logits, pooled = self._run(entries)
        return StepOutput(logits, pooled)

    def _run(self, entries: list[ForwardEntry]) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        no_pooling: list[torch.Tensor | None] = [None] * len(entries)
        if not entries:  # every rank gets the same entries, so every rank skips the collectives
            empty = torch.empty(0, self.info.vocab_size, dtype=torch.float32, device=self.device)
            return (empty if self.config.rank == 0 else None), no_pooling
        if self.graphs is not None and self.graphs.applies(entries):
            return self.graphs.run(entries), no_pooling
        token_ids, batch, sample_indices = self._layout(entries)
        step = self.backend.plan(batch, self.pool)
        model = self.model
        hidden = model.embed(token_ids)
        if self.fused is not None and self.fused.applies(step) and model.fused_applies(step):
            hidden, residual = self.fused.run(hidden, step)  # the same kernels, one call per layer
        else:
            hidden, residual = model.run_layers(hidden, step)
        logits = model.logits(hidden, residual, sample_indices)
        pooled = no_pooling
        if self.config.rank == 0 and any(entry.pooling for entry in entries):
            pooled = self._pool(entries, hidden, residual)
        return (None if logits is None else logits.float()), pooled

    def _pool(self, entries: list[ForwardEntry], hidden: torch.Tensor,
              residual: torch.Tensor) -> list[torch.Tensor | None]:
        """Rank 0: the embedding entries' pooled rows (see `StepOutput`), over the flat layout
        `_layout` made (decode tokens first, then each prefill chunk in entry order)."""
        flat: list[tuple[int, int]] = []  # each entry's [first, end) in the flat layout
        num_decode = sum(1 for entry in entries if len(entry.token_ids) == 1)
        next_decode, next_prefill = 0, num_decode
        for entry in entries:
            if len(entry.token_ids) == 1:
                flat.append((next_decode, next_decode + 1))
                next_decode += 1
            else:
                flat.append((next_prefill, next_prefill + len(entry.token_ids)))
                next_prefill += len(entry.token_ids)
        pooled: list[torch.Tensor | None] = []
        for entry, (first, end) in zip(entries, flat):
            if entry.pooling == worker_pb2.POOLING_MODE_MEAN:
                indices = torch.arange(first, end, device=self.device)
                pooled.append(self.model.final_hidden(hidden, residual, indices).float().sum(dim=0))
            elif entry.pooling == worker_pb2.POOLING_MODE_LAST and entry.last:
                indices = torch.tensor([end - 1], device=self.device)
                pooled.append(self.model.final_hidden(hidden, residual, indices).float()[0])
            else:
                pooled.append(None)
        return pooled

    def _layout(self, entries: list[ForwardEntry]) -> tuple[torch.Tensor, StepBatch, torch.Tensor]:
        """Flat token layout (decode tokens first, then each prefill chunk) and its description.

        Returns token ids [T], the step for the backend to plan, and the flat indices of the last
        `num_logits` tokens of each sampled entry (entry order). Python work is per entry, not per token.
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

        chunks: list[PrefillChunk] = []
        longest = max(context_lens, default=0)
        for i in prefill:
            entry = entries[i]
            start, end = entry.start_position, entry.start_position + len(entry.token_ids)
            longest = max(longest, end)
            page_ids = entry.page_table[: (end - 1) // page_size + 1]
            pages = torch.tensor(page_ids)
            write_slots.append(context_slots(pages, end, page_size)[start:])
            chunks.append(PrefillChunk(len(token_ids), start, end - start, page_ids, pages))
            token_ids.extend(entry.token_ids)
            positions.extend(range(start, end))
            last_token_index[i] = len(token_ids) - 1

        batch = StepBatch(
            page_size=page_size,
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            write_slots=torch.cat(write_slots).to(device),
            decode_tables=tables,
            decode_context_lens=context_lens,
            prefills=chunks,
            longest_context=longest,
        )
        sample_indices = [
            index
            for i, entry in enumerate(entries) if entry.sample
            for index in range(last_token_index[i] - entry.num_logits + 1, last_token_index[i] + 1)
        ]
        return (
            torch.tensor(token_ids, dtype=torch.int64, device=device),
            batch,
            torch.tensor(sample_indices, dtype=torch.int64, device=device),
        )
