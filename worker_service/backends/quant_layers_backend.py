"""The PyTorch backend with compiled decoder layers for quantized weights (`fused_quant_llama.py`).

Everything is the PyTorch backend's (`torch_backend.py`: it reports itself as "torch") except the
whole-layer path the runner may take for decode steps: for a model that declares its layer
`"llama"`, on one TP rank, its layers' quantized products and the ops between them run as one
compiled call per layer (`csrc/quant_decode_layer.cpp`, an AVX2 library of its own). It is chosen
by `selection.py` alone, where the main compiled library does not run and weights are quantized.
"""

from __future__ import annotations

import torch

from worker_service.backends.base import FusedLayers
from worker_service.backends.fused_quant_llama import FusedQuantLlamaLayers
from worker_service.backends.grouped_experts import ExpertProducts
from worker_service.backends.linear_quant import QuantizedLinears
from worker_service.backends.torch_backend import TorchBackend
from worker_service.kv_pool import KVPool
from worker_service.native.quant_layer_kernels import QuantLayerKernels

# The layer kinds this backend runs whole, by what models declare as their `fusable_layer`.
FUSED_LAYERS = {"llama": FusedQuantLlamaLayers}


class QuantLayersBackend(TorchBackend):
    def __init__(self, layer_kernels: QuantLayerKernels, dtype: torch.dtype, world_size: int,
                 quantized: QuantizedLinears, experts: ExpertProducts | None = None) -> None:
        super().__init__(torch.device("cpu"), dtype, quantized, experts)
        self.layer_kernels = layer_kernels
        self.world_size = world_size

    def fused_layers(self, model: torch.nn.Module, pool: KVPool) -> FusedLayers | None:
        """The model's layers as compiled calls where it declares a layer kind fused here and runs
        on one rank (a row-parallel layer's all-reduce would sit inside the call); else None."""
        fused = FUSED_LAYERS.get(type(model).fusable_layer)
        if fused is None or self.world_size != 1:
            return None
        return fused.build(self.layer_kernels, model, pool)
