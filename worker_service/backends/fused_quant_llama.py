"""Llama decoder layers with quantized weights in one compiled call each, for decode steps on CPUs
where the main compiled library (and its fused layer, `fused_llama.py`) does not build.

There the PyTorch backend runs a decode step, and at a few rows its time goes to the ops around
the quantized products (RMSNorm, RoPE, the page gathers of attention, SwiGLU, residual adds, each
one or more PyTorch calls with their own allocations) and to Python between them.
`csrc/quant_decode_layer.cpp` computes the whole layer (`models/llama.py`'s order) in float32
with the same quantized products (`quant_gemv.cpp`, or `quant_gemv_int8.cpp` over activations
rounded to 8 bits where the worker's products are packed so) and writes K/V into the pool as a cast to its
dtype rounds, so its results are the PyTorch backend's within float32 rounding where the model runs
in float32; in bfloat16 they differ by the roundings that path makes between ops and this one
does not (its activations stay float32 from the embeddings to the last layer's output).

It runs where the layer's code does: a model declaring `fusable_layer = "llama"` on one TP rank,
every linear layer of its decoder layers packed as `CompiledQuantLinear` (not a `StackedLinear` of
differently quantized row blocks), a head size and page size the C++ code takes, and steps of at
most `GEMV_MAX_ROWS` tokens. Other steps take the module path.

Every token of a step is one row of the C++ code: a decode row with its page table, and each token
of a prefill chunk (a prompt's first or next chunk, or the 1 + k tokens of a speculative verify
step) with its chunk's pages and its own position. Each row attends over positions 0 .. its own,
and a layer writes every row's K/V before any row's attention, so a chunk's token sees the tokens
before it in the same step: the causal attention of the module path.
"""

from __future__ import annotations

import ctypes
import math

import torch

from worker_service.backends.base import StepContext
from worker_service.backends.linear_quant import GEMV_MAX_ROWS, CompiledQuantLinear
from worker_service.kv_pool import KVPool
from worker_service.native import quant_layer_kernels as layer_kernels
from worker_service.native.quant_layer_kernels import (QuantLayerKernels, QuantLayerWeights, QuantLinearArgs,
                                                       QuantStepArgs)
from worker_service.quant.kernels import FORMAT_CODES

POOL_DTYPES = {torch.float32: layer_kernels.POOL_FLOAT32, torch.bfloat16: layer_kernels.POOL_BFLOAT16}


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _linear_args(linear: CompiledQuantLinear) -> QuantLinearArgs:
    weight = linear.quantized
    return QuantLinearArgs(format=FORMAT_CODES[weight.format], values=weight.values.data_ptr(),
                           scales=weight.scales.data_ptr(), offsets=_address(weight.offsets),
                           bias=_address(linear.bias), n=weight.out_features, k=weight.in_features,
                           group_size=weight.group_size)


def _linears(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    attention, mlp = layer.self_attn, layer.mlp
    return attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj


class FusedQuantLlamaLayers:
    """A Llama model's quantized layers as compiled calls; `run(embedded hidden, step)` is the loop."""

    def __init__(self, kernels: QuantLayerKernels, model: torch.nn.Module, pool: KVPool) -> None:
        self._call = kernels.decode_layers
        first = model.layers[0]
        num_q, num_kv, head_dim = first.self_attn.num_q_heads, first.self_attn.num_kv_heads, first.self_attn.head_dim
        intermediate = first.mlp.gate_up_proj.output_sizes[0]
        hidden = model.config.hidden_size
        self._dtype = pool.buffer.dtype
        # float32 copies the C++ code reads (norm weights, RoPE tables), kept alive here.
        self._keep: list[torch.Tensor] = []
        self._layers = []
        for index, layer in enumerate(model.layers):
            k_slots, v_slots = pool.slots(index)
            input_norm = self._float(layer.input_layernorm.weight)
            post_norm = self._float(layer.post_attention_layernorm.weight)
            qkv, o_proj, gate_up, down = (_linear_args(linear.packed) for linear in _linears(layer))
            self._layers.append(QuantLayerWeights(
                hidden=hidden, num_q_heads=num_q, num_kv_heads=num_kv, head_dim=head_dim, intermediate=intermediate,
                pool_dtype=POOL_DTYPES[self._dtype], input_eps=layer.input_layernorm.eps,
                post_eps=layer.post_attention_layernorm.eps, input_norm=input_norm, post_norm=post_norm,
                qkv=qkv, o_proj=o_proj, gate_up=gate_up, down=down,
                k_pool=k_slots.data_ptr(), v_pool=v_slots.data_ptr(), kv_head_stride=k_slots.stride(0)))
        self._layer_array = (ctypes.c_void_p * len(self._layers))(*(ctypes.addressof(layer) for layer in self._layers))
        self._page_size = pool.page_size
        args = self._args = QuantStepArgs()
        args.cos, args.sin = self._float(model.rotary.cos), self._float(model.rotary.sin)
        args.page_size, args.softmax_scale = pool.page_size, 1.0 / math.sqrt(head_dim)
        # One choice for the worker's products (`QuantizedLinears`): the layer's are packed alike.
        args.int8_activations = int(first.self_attn.qkv_proj.packed.int8_activations)
        # Room for the largest step; a step of fewer rows uses the start of each buffer.
        widths = [hidden, (num_q + 2 * num_kv) * head_dim, num_q * head_dim, 2 * intermediate, intermediate]
        self._scratch = [torch.empty(GEMV_MAX_ROWS, width, dtype=torch.float32) for width in widths]
        args.normed, args.qkv, args.attended, args.gate_up, args.act = (t.data_ptr() for t in self._scratch)
        self._args_address = ctypes.addressof(args)

    def _float(self, tensor: torch.Tensor) -> int:
        copy = tensor.detach().float().contiguous()
        self._keep.append(copy)
        return copy.data_ptr()

    @classmethod
    def build(cls, kernels: QuantLayerKernels, model: torch.nn.Module, pool: KVPool) -> FusedQuantLlamaLayers | None:
        """The fused layers where the C++ code takes this model and pool (module doc), else None."""
        attention = model.layers[0].self_attn
        head_dim = attention.head_dim
        if (pool.buffer.dtype not in POOL_DTYPES or head_dim % layer_kernels.HEAD_DIM_MULTIPLE
                or head_dim > layer_kernels.MAX_HEAD_DIM or pool.page_size > layer_kernels.MAX_PAGE_SIZE):
            return None
        for layer in model.layers:
            if layer.self_attn.options is not None:
                return None
            if not all(type(linear.packed) is CompiledQuantLinear and not linear.packed.float32_out
                       for linear in _linears(layer)):
                return None
        return cls(kernels, model, pool)

    def applies(self, step: StepContext) -> bool:
        return step.batch is not None and 0 < step.positions.shape[0] <= GEMV_MAX_ROWS

    def run(self, hidden: torch.Tensor, step: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers over `hidden` (the embeddings, `[T, H]`): (the last MLP output, the residual
        stream), in the model's dtype, as the module loop returns them."""
        batch = step.batch
        # One page table a row, in the step's flat order: the decode rows, then each chunk's tokens.
        tables = list(batch.decode_tables)
        for chunk in batch.prefills:
            tables.extend([chunk.page_ids] * chunk.num_tokens)
        max_pages = max(len(table) for table in tables)
        page_tables = torch.tensor([table + [0] * (max_pages - len(table)) for table in tables], dtype=torch.int64)
        positions = step.positions.contiguous()
        write_slots = step.write_slots.contiguous()
        args = self._args
        args.rows, args.num_threads, args.max_pages = len(tables), torch.get_num_threads(), max_pages
        args.positions, args.write_slots = positions.data_ptr(), write_slots.data_ptr()
        args.page_tables = page_tables.data_ptr()
        state = hidden.to(torch.float32, copy=True).contiguous()
        residual = torch.empty_like(state)
        # All layers in one call: one parallel region a step (csrc/quant_decode_layer.cpp).
        # raises KernelError on failure
        self._call(self._layer_array, len(self._layers), self._args_address, state.data_ptr(), residual.data_ptr())
        return state.to(self._dtype), residual.to(self._dtype)
