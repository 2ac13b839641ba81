"""The model runner: one rank's weights and KV pool, and one batched forward pass per step.

`ModelRunner.forward(entries)` takes the step's entries (prefill chunks starting at any position
and single decode tokens, in any mix), lays their tokens out flat (decode tokens first), builds
the page-table metadata once, runs the model, and returns on rank 0 the float32 logits of the
last token of every `sample=True` entry, in entry order. Every rank must be called with the same
entries; with world_size > 1 the caller has already joined the process group
(`distributed.init_distributed`). Entries are assumed valid (the executor checks them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from worker_service.attention import AttentionBatch, PrefillSpan, context_slots
from worker_service.distributed import TPGroup
from worker_service.forward_batch import ForwardEntry, ModelInfo
from worker_service.kv_pool import KVPool
from worker_service.loader import load_weights
from worker_service.models import model_class
from worker_service.models.llama import StepContext, head_dim_of

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(slots=True, frozen=True)
class RunnerConfig:
    model_dir: Path
    device: str = "cpu"
    dtype: str = "float32"
    page_size: int = 16
    kv_cache_bytes: int = 1 << 30
    rank: int = 0
    world_size: int = 1


def eos_token_ids(model_dir: Path, config_eos: int | list[int] | None) -> list[int]:
    """EOS ids from config.json and generation_config.json together, first-seen order."""
    found: list[int] = []
    sources: list[int | list[int] | None] = [config_eos]
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    for source in sources:
        ids = [] if source is None else [source] if isinstance(source, int) else list(source)
        found.extend(i for i in ids if i not in found)
    return found


class ModelRunner:
    def __init__(self, config: RunnerConfig) -> None:
        if config.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {config.dtype!r}; choose from {sorted(DTYPES)}")
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.page_size = config.page_size
        model_dir = Path(config.model_dir)
        self.hf_config = AutoConfig.from_pretrained(model_dir)
        group = TPGroup(config.rank, config.world_size)
        with torch.inference_mode():
            self.model = model_class(self.hf_config)(self.hf_config, group, self.dtype, self.device)
        load_weights(self.model, model_dir)
        self.model.eval()

        shape = (self.hf_config.num_hidden_layers, config.page_size, self.model.num_kv_heads,
                 head_dim_of(self.hf_config))
        num_pages = KVPool.pages_for_budget(config.kv_cache_bytes, *shape, dtype=self.dtype)
        self.pool = KVPool(shape[0], num_pages, config.page_size, shape[2], shape[3],
                           self.dtype, self.device)
        self.info = ModelInfo(
            model_name=model_dir.name,
            dtype=config.dtype,
            device=str(self.device),
            page_size=config.page_size,
            num_pages=num_pages,
            context_len=self.hf_config.max_position_embeddings,
            vocab_size=self.hf_config.vocab_size,
            eos_token_ids=eos_token_ids(model_dir, self.hf_config.eos_token_id),
            rank=config.rank,
            world_size=config.world_size,
        )

    def weight_bytes(self) -> int:
        """Bytes of this rank's parameters (a tied embedding counted once)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.inference_mode()
    def forward(self, entries: list[ForwardEntry]) -> torch.Tensor | None:
        """One step over `entries`; float32 logits `[num_sampled, vocab]` on rank 0, else None."""
        token_ids, positions, slots, attention, sample_indices = self._layout(entries)
        step = StepContext(positions=positions, attention=attention, pool=self.pool)
        logits = self.model(token_ids, step, sample_indices)
        return None if logits is None else logits.float()

    def _layout(self, entries: list[ForwardEntry]):
        """Flat token layout (decode tokens first, then each prefill chunk) and its metadata."""
        page_size = self.page_size
        decode = [i for i, entry in enumerate(entries) if len(entry.token_ids) == 1]
        prefill = [i for i, entry in enumerate(entries) if len(entry.token_ids) > 1]
        token_ids: list[int] = []
        positions: list[int] = []
        write_slots: list[torch.Tensor | list[int]] = []
        last_token_index: dict[int, int] = {}

        decode_slots: list[int] = []
        context_lens: list[int] = []
        decode_tables: list[list[int]] = []
        for flat_index, i in enumerate(decode):
            entry = entries[i]
            position = entry.start_position
            token_ids.append(entry.token_ids[0])
            positions.append(position)
            decode_slots.append(entry.page_table[position // page_size] * page_size + position % page_size)
            context_lens.append(position + 1)
            decode_tables.append(entry.page_table[: position // page_size + 1])
            last_token_index[i] = flat_index
        write_slots.append(decode_slots)

        decode_context_slots = decode_mask = None
        if decode:
            max_len = max(context_lens)
            num_table_pages = max(len(table) for table in decode_tables)
            tables = torch.tensor([t + [0] * (num_table_pages - len(t)) for t in decode_tables])
            decode_context_slots = context_slots(tables, max_len, page_size)
            lens = torch.tensor(context_lens)
            decode_mask = (torch.arange(max_len) < lens.unsqueeze(1)).view(len(decode), 1, 1, max_len)

        spans: list[PrefillSpan] = []
        for i in prefill:
            entry = entries[i]
            start, num_new = entry.start_position, len(entry.token_ids)
            end = start + num_new
            table = torch.tensor(entry.page_table[: (end - 1) // page_size + 1])
            token_start = len(token_ids)
            token_ids.extend(entry.token_ids)
            positions.extend(range(start, end))
            all_slots = context_slots(table, end, page_size)
            write_slots.append(all_slots[start:])
            span_slots = span_mask = None
            if start > 0:
                span_slots = all_slots
                query_positions = torch.arange(start, end).unsqueeze(1)
                span_mask = torch.arange(end).unsqueeze(0) <= query_positions
            spans.append(PrefillSpan(token_start, len(token_ids), span_slots, span_mask))
            last_token_index[i] = len(token_ids) - 1

        device = self.device
        flat_slots = torch.cat([torch.as_tensor(s, dtype=torch.int64) for s in write_slots])
        sample_indices = [last_token_index[i] for i, entry in enumerate(entries) if entry.sample]
        attention = AttentionBatch(
            write_slots=flat_slots.to(device),
            num_decode=len(decode),
            decode_context_slots=None if decode_context_slots is None else decode_context_slots.to(device),
            decode_mask=None if decode_mask is None else decode_mask.to(device),
            prefills=[
                PrefillSpan(s.token_start, s.token_stop,
                            None if s.context_slots is None else s.context_slots.to(device),
                            None if s.mask is None else s.mask.to(device))
                for s in spans
            ],
        )
        return (
            torch.tensor(token_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            flat_slots,
            attention,
            torch.tensor(sample_indices, dtype=torch.int64, device=device),
        )
