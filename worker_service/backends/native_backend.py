"""The compiled CPU kernels' backend (`worker_service.native`).

Attention is one kernel call per layer for every row of the step, decode and prefill, reading
K/V through the page tables where they lie (shared prefixes once per group, as the PyTorch
backend's cascade), attention sinks included (GPT-OSS's: one more term of each query head's
softmax denominator, added where the kernel merges its partial sums); the row-wise ops are the
compiled ones (`row_kernels.py`); linear layers of decode-sized steps use the small-batch kernel (`linear_native.py`). Rank 0 samples with the
compiled sampling kernels.

Whole-layer fusion: for a model that declares its layer `"llama"` (`models/base.py`), a single
rank, and a dtype every kernel of the layer runs in, decode-sized steps run each decoder layer
as one compiled call (`fused_llama.py`).
"""

from __future__ import annotations

import torch

from worker_service.attention.decode_plan import shared_prefixes
from worker_service.backends.base import ATTENTION_SINKS, FusedLayers, PackedLinear, StepBatch, StepContext
from worker_service.backends.fused_llama import FusedLlamaLayers
from worker_service.backends.grouped_experts import ExpertProducts
from worker_service.backends.linear_native import NativeLinear
from worker_service.backends.linear_quant import QuantizedLinears
from worker_service.backends.linear_torch import TorchLinear
from worker_service.backends.row_kernels import RowKernelBackend
from worker_service.kv_pool import KVPool
from worker_service.native import NativeKernels
from worker_service.quant.format import QuantizedWeight
from worker_service.sampling import Sampler

# The layer kinds this backend runs whole, by what models declare as their `fusable_layer`.
FUSED_LAYERS = {"llama": FusedLlamaLayers}


class NativeBackend(RowKernelBackend):
    name = "native"

    def __init__(self, kernels: NativeKernels, dtype: torch.dtype, world_size: int = 1,
                 quantized: QuantizedLinears | None = None, experts: ExpertProducts | None = None) -> None:
        super().__init__(torch.device("cpu"), dtype, kernels, quantized, experts)
        self.kernels = kernels
        self.world_size = world_size

    def plan(self, batch: StepBatch, pool: KVPool) -> StepContext:
        tables, lens, page_size = batch.decode_tables, batch.decode_context_lens, batch.page_size
        spans = [(chunk.token_start, chunk.num_tokens, chunk.start_position, chunk.page_ids)
                 for chunk in batch.prefills]
        plan = self.kernels.plan(tables, lens, page_size, shared_prefixes(tables, lens, page_size), spans)
        return StepContext(batch.positions, batch.write_slots, plan, pool, batch)

    kernel_ops = (ATTENTION_SINKS,)

    def _attend_stored(self, qkv: torch.Tensor, num_q_heads: int, k_slots: torch.Tensor, v_slots: torch.Tensor,
                       step: StepContext, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return step.attention.attend(qkv[:, :num_q_heads], k_slots, v_slots, sinks)  # q read where it is

    def pack(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None, *,
             float32_out: bool = False) -> PackedLinear:
        if isinstance(weight, QuantizedWeight):  # no fused layers then (they need `NativeLinear`s)
            return self.quantized.pack(weight, bias, float32_out)
        larger = TorchLinear(weight, bias, float32_out)
        gemv = self.kernels.pack_gemv(weight)  # from the plain weight
        return larger if gemv is None else NativeLinear(self.kernels, gemv, bias, larger)

    def fused_layers(self, model: torch.nn.Module, pool: KVPool) -> FusedLayers | None:
        """The model's layers as compiled calls where it declares a layer kind fused here, runs on
        one rank (a row-parallel layer's all-reduce would sit between kernels) and every linear
        layer has the small-batch kernel's copy; else None."""
        fused = FUSED_LAYERS.get(type(model).fusable_layer)
        if fused is None or self.world_size != 1 or pool.buffer.dtype not in self.kernels.gemv_dtypes:
            return None
        return fused.build(self.kernels, model, pool)

    def new_sampler(self, seed: int | None = None) -> Sampler:
        return Sampler(self.device, seed, kernels=self.kernels)
