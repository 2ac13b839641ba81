"""The compiled decoder layer over quantized weights (`csrc/quant_decode_layer.cpp`, with the
quantized products of `csrc/quant_gemv.cpp` and `csrc/quant_gemv_int8.cpp` linked in), and the ctypes structs it reads.

Like the quantized products (`quant/kernels.py`) it is a library of its own, built by
`native.library.build` with AVX2 and FMA only, so it builds on CPUs without AVX-512, where the
whole-layer kernel of the main library (`csrc/decode_layer.cpp`) does not. `load()` builds it once
per process (None where it cannot be built: no compiler, no AVX2/FMA; `failure()` says why).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from worker_service.native.library import CSRC, LazyLibrary
from worker_service.native.signatures import Signature, bind

SOURCES = [CSRC / "quant_decode_layer.cpp", CSRC / "quant_gemv.cpp", CSRC / "quant_gemv_int8.cpp"]
COMPILE_FLAGS = ["-O3", "-march=native", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
REQUIRED_CPU_FLAGS = ("avx2", "fma")
# The pool dtypes the layer reads and writes (`kPoolFloat32`, `kPoolBFloat16` in the source).
POOL_FLOAT32, POOL_BFLOAT16 = 0, 1
# Head sizes and page sizes the layer takes (it refuses others with status 3).
MAX_HEAD_DIM, MAX_PAGE_SIZE, HEAD_DIM_MULTIPLE = 256, 64, 8

_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class QuantLinearArgs(ctypes.Structure):
    """Mirror of `QuantLinearArgs` in quant_decode_layer.cpp."""

    _fields_ = [("format", _i32), ("values", _ptr), ("scales", _ptr), ("offsets", _ptr), ("bias", _ptr),
                ("n", _i64), ("k", _i64), ("group_size", _i64)]


class QuantLayerWeights(ctypes.Structure):
    """Mirror of `QuantLayerWeights` in quant_decode_layer.cpp."""

    _fields_ = [("hidden", _i32), ("num_q_heads", _i32), ("num_kv_heads", _i32), ("head_dim", _i32),
                ("intermediate", _i32), ("pool_dtype", _i32), ("input_eps", _f32), ("post_eps", _f32),
                ("input_norm", _ptr), ("post_norm", _ptr),
                ("qkv", QuantLinearArgs), ("o_proj", QuantLinearArgs), ("gate_up", QuantLinearArgs),
                ("down", QuantLinearArgs),
                ("k_pool", _ptr), ("v_pool", _ptr), ("kv_head_stride", _i64)]


class QuantStepArgs(ctypes.Structure):
    """Mirror of `QuantStepArgs` in quant_decode_layer.cpp."""

    _fields_ = [("rows", _i32), ("num_threads", _i32), ("page_size", _i32), ("max_pages", _i32),
                ("positions", _ptr), ("write_slots", _ptr), ("page_tables", _ptr),
                ("cos", _ptr), ("sin", _ptr), ("softmax_scale", _f32),
                ("normed", _ptr), ("qkv", _ptr), ("attended", _ptr), ("gate_up", _ptr), ("act", _ptr),
                ("int8_activations", _i32)]


SIGNATURES = {
    "radix_quant_layer_supported": Signature(()),
    "radix_quant_decode_layers": Signature((_ptr, _i32, _ptr, _ptr, _ptr), checked=True),
}


class QuantLayerKernels:
    """The loaded library (`path`): `decode_layers(array of weights addresses, count, step address,
    hidden, residual)` is `radix_quant_decode_layers` (raises `KernelError` where it refuses the
    call)."""

    def __init__(self, path: Path) -> None:
        lib = bind(ctypes.CDLL(str(path)), SIGNATURES)
        if not lib.radix_quant_layer_supported():
            raise RuntimeError("the quantized decoder layer was built without AVX2 and FMA")
        self.decode_layers = lib.radix_quant_decode_layers


_library = LazyLibrary("radixserve-quant-layer", SOURCES, COMPILE_FLAGS, REQUIRED_CPU_FLAGS, QuantLayerKernels)
# The library, built on first use; None where it cannot be (then `failure()` says why).
load = _library.load
failure = _library.failure
