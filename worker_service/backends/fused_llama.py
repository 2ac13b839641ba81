"""Llama decoder layers in one compiled call each, for decode steps (the compiled-kernels
backend's whole-layer fusion, for models that declare `fusable_layer = "llama"`).

Between a layer's kernels the module path spends Python time (module calls, views, ctypes
arguments) that is a sizeable part of a small model's decode step. `csrc/decode_layer.cpp` calls
the same kernels in the same order on the same buffers (so the results are the same bits as
`models/llama.py` on the compiled-kernels backend); here the per-layer arguments are laid out once
at load and the per-step ones once per step. The C++ code is Llama's layer (RMSNorm, merged q/k/v
with an optional bias, RoPE, attention, o_proj, RMSNorm, gate/up, SwiGLU, down): a model whose
layer differs in any of these must not declare it.

It runs where every kernel of the layer does: a dtype the small-batch linear kernel takes, every
linear layer packed for it, a single TP rank (a row-parallel layer's all-reduce would sit between
kernels), and steps of at most `GEMV_MAX_ROWS` tokens. Other steps take the module path.
"""

from __future__ import annotations

import ctypes
import torch

from worker_service.backends.base import StepContext
from worker_service.backends.linear_native import GEMV_MAX_ROWS, NativeLinear
from worker_service.kv_pool import KVPool
from worker_service.native import DTYPE_CODES, NativeKernels


class _LayerWeights(ctypes.Structure):
    """Mirror of `LayerWeights` in decode_layer.cpp."""

    _fields_ = [
        ("dtype", ctypes.c_int32),
        ("hidden", ctypes.c_int32), ("num_q_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32), ("intermediate", ctypes.c_int32),
        ("input_eps", ctypes.c_float), ("post_eps", ctypes.c_float),
        ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
        ("qkv", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p), ("o_proj", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p),
        ("k_pool", ctypes.c_void_p), ("v_pool", ctypes.c_void_p), ("kv_head_stride", ctypes.c_int64),
    ]


class _StepArgs(ctypes.Structure):
    """Mirror of `StepArgs` in decode_layer.cpp."""

    _fields_ = [
        ("rows", ctypes.c_int32), ("num_threads", ctypes.c_int32),
        ("positions", ctypes.c_void_p), ("write_slots", ctypes.c_void_p),
        ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
        ("plan", ctypes.c_void_p), ("schedule", ctypes.c_void_p),
        ("normed", ctypes.c_void_p), ("qkv", ctypes.c_void_p), ("attended", ctypes.c_void_p),
        ("delta", ctypes.c_void_p), ("gate_up", ctypes.c_void_p), ("act", ctypes.c_void_p),
    ]


class FusedLlamaLayers:
    """A Llama model's layers as compiled calls; `run(embedded hidden, step)` is the loop."""

    def __init__(self, kernels: NativeKernels, model: torch.nn.Module, pool: KVPool) -> None:
        self._call = kernels.lib.radix_decode_layer
        self._layers = []
        first = model.layers[0]
        self._shape = (first.self_attn.num_q_heads, first.self_attn.num_kv_heads, first.self_attn.head_dim,
                       first.mlp.gate_up_proj.output_sizes[0])
        num_q, num_kv, head_dim, intermediate = self._shape
        for index, layer in enumerate(model.layers):
            attention, mlp = layer.self_attn, layer.mlp
            k_slots, v_slots = pool.slots(index)
            bias = attention.qkv_proj.bias
            self._layers.append(_LayerWeights(
                dtype=DTYPE_CODES[pool.buffer.dtype], hidden=model.config.hidden_size, num_q_heads=num_q, num_kv_heads=num_kv, head_dim=head_dim,
                intermediate=intermediate,
                input_eps=layer.input_layernorm.eps, post_eps=layer.post_attention_layernorm.eps,
                input_norm=layer.input_layernorm.weight.data_ptr(),
                post_norm=layer.post_attention_layernorm.weight.data_ptr(),
                qkv=attention.qkv_proj.packed.gemv.packed.data_ptr(), qkv_bias=None if bias is None else bias.data_ptr(),
                o_proj=attention.o_proj.packed.gemv.packed.data_ptr(),
                gate_up=mlp.gate_up_proj.packed.gemv.packed.data_ptr(),
                down=mlp.down_proj.packed.gemv.packed.data_ptr(),
                k_pool=k_slots.data_ptr(), v_pool=v_slots.data_ptr(), kv_head_stride=k_slots.stride(0),
            ))
        self._pool = pool
        self._rotary = model.rotary
        self._hidden_size = model.config.hidden_size
        self._args = _StepArgs()
        self._args_address = ctypes.addressof(self._args)
        self._layer_addresses = [ctypes.addressof(layer) for layer in self._layers]
        # Room for the largest step; a step of fewer rows uses the start of each buffer.
        widths = [self._hidden_size, (num_q + 2 * num_kv) * head_dim, num_q * head_dim, self._hidden_size,
                  2 * intermediate, intermediate]
        self._dtype = pool.buffer.dtype
        self._scratch = [torch.empty(GEMV_MAX_ROWS, width, dtype=self._dtype) for width in widths]

    @classmethod
    def build(cls, kernels: NativeKernels, model: torch.nn.Module, pool: KVPool) -> FusedLlamaLayers | None:
        """The fused layers where every linear layer of the model has the small-batch kernel's copy."""
        for layer in model.layers:
            linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if not all(isinstance(linear.packed, NativeLinear) for linear in linears):
                return None
        return cls(kernels, model, pool)

    def applies(self, step: StepContext) -> bool:
        return step.positions.shape[0] <= GEMV_MAX_ROWS

    def run(self, hidden: torch.Tensor, step: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers over `hidden` (the embeddings, `[T, H]`, overwritten): (the last MLP output,
        the residual stream), as the module loop returns them."""
        rows = hidden.shape[0]
        num_q, num_kv, head_dim, intermediate = self._shape
        plan, schedule = step.attention.bound(num_q, head_dim, self._dtype, (num_q + 2 * num_kv) * head_dim,
                                                     num_kv, self._layers[0].kv_head_stride)
        args = self._args
        args.rows, args.num_threads = rows, torch.get_num_threads()
        args.positions, args.write_slots = step.positions.data_ptr(), step.write_slots.data_ptr()
        args.cos, args.sin = self._rotary.cos.data_ptr(), self._rotary.sin.data_ptr()
        args.plan, args.schedule = plan, schedule
        (args.normed, args.qkv, args.attended, args.delta, args.gate_up,
         args.act) = (tensor.data_ptr() for tensor in self._scratch)
        hidden = hidden.contiguous()
        residual = torch.empty_like(hidden)
        hidden_ptr, residual_ptr, args_address = hidden.data_ptr(), residual.data_ptr(), self._args_address
        call = self._call
        for index, layer in enumerate(self._layer_addresses):
            call(layer, args_address, hidden_ptr, residual_ptr, index == 0)  # raises KernelError on failure
        return hidden, residual
