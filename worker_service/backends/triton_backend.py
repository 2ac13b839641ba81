"""The CUDA backend: Triton kernels for decode attention and the row-wise ops, CUDA graphs for
whole decode steps.

Decode rows attend by one Triton kernel reading K/V straight from the pool through their page
tables (`attention/gpu_decode.py`, `attention/triton_decode.py`); prefill chunks by PyTorch's
SDPA as on the PyTorch backend. The row-wise ops are Triton's (`triton_row_ops.py`). Linear
layers are cuBLAS's (`F.linear`). With `graph_max_batch > 0`, decode steps of up to that many
rows replay captured CUDA graphs (`cuda_graphs.py`); the pool then holds one page beyond the
router's for the graphs' padding rows.
"""

from __future__ import annotations

import torch

from worker_service.attention import paged_attention
from worker_service.attention.gpu_decode import plan_gpu_decode
from worker_service.attention.paged import DecodeAttention
from worker_service.backends.base import StepBatch, StepContext, WholeSteps
from worker_service.backends.cuda_graphs import DecodeGraphs
from worker_service.backends.linear_quant import QuantizedLinears
from worker_service.backends.row_kernels import RowKernelBackend
from worker_service.backends.triton_row_ops import TritonRowOps
from worker_service.kv_pool import KVPool


class TritonBackend(RowKernelBackend):
    name = "triton"

    def __init__(self, device: torch.device, dtype: torch.dtype, graph_max_batch: int = 0,
                 quantized: QuantizedLinears | None = None) -> None:
        super().__init__(device, dtype, TritonRowOps(), quantized)
        self.graph_max_batch = graph_max_batch
        self.extra_pages = 1 if graph_max_batch > 0 else 0

    def _plan_decode(self, batch: StepBatch) -> DecodeAttention:
        return plan_gpu_decode(batch.decode_tables, batch.decode_context_lens, batch.page_size, self.device)

    def _attend_stored(self, qkv: torch.Tensor, num_q_heads: int, k_slots: torch.Tensor, v_slots: torch.Tensor,
                       step: StepContext, sinks: torch.Tensor | None = None) -> torch.Tensor:
        num_kv_heads = k_slots.shape[0]
        q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
        return paged_attention(q, k, v, k_slots, v_slots, step.attention, stored=True)

    def whole_steps(self, model: torch.nn.Module, pool: KVPool, context_len: int,
                    pad_page: int) -> WholeSteps | None:
        if self.graph_max_batch == 0:
            return None
        return DecodeGraphs(model, pool, context_len, self.graph_max_batch, pad_page)
