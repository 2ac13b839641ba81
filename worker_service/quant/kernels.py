"""The compiled quantized products (`csrc/quant_gemv.cpp`) over torch tensors.

They are a library of their own, built by `native.library.build` with AVX2 and FMA only: the
machines without AVX-512, where the other compiled kernels do not build, still multiply
quantized weights without widening them. Each product takes its activations in float32 as
they are, or (`int8_activations`) quantized to 8 bits per block of 32 columns and multiplied in
integers (`csrc/quant_gemv_int8.cpp`: the float32 product over the dequantized weight of the
activations as that quantization rounds them). `load()` builds it once per process (None where it
cannot be built: no compiler, no AVX2/FMA; `failure()` says why).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from worker_service.native.library import CSRC, LazyLibrary
from worker_service.native.signatures import Signature, bind
from worker_service.quant.format import QuantizedWeight

SOURCES = [CSRC / "quant_gemv.cpp", CSRC / "quant_gemv_int8.cpp"]
COMPILE_FLAGS = ["-O3", "-march=native", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
REQUIRED_CPU_FLAGS = ("avx2", "fma")
FORMAT_CODES = {"int8": 0, "int4": 1}

_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_GEMV_ARGS = (_i32, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i32)
SIGNATURES = {
    "radix_quant_supported": Signature(()),
    "radix_quant_gemv": Signature(_GEMV_ARGS, checked=True),
    "radix_quant_gemv_int8_activations": Signature(_GEMV_ARGS, checked=True),
    "radix_quant_dequantize": Signature((_i32, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i32), checked=True),
}


class QuantKernels:
    """The loaded library (`path`), its functions typed by `SIGNATURES`."""

    def __init__(self, path: Path) -> None:
        lib = bind(ctypes.CDLL(str(path)), SIGNATURES)
        if not lib.radix_quant_supported():
            raise RuntimeError("the quantized kernels were built without AVX2 and FMA")
        self._gemv = {False: lib.radix_quant_gemv, True: lib.radix_quant_gemv_int8_activations}
        self._dequantize = lib.radix_quant_dequantize

    def gemv(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None,
             int8_activations: bool = False) -> torch.Tensor:
        """`x` `[rows, K]` times `weight`'s transpose (+ `bias`) -> float32 `[rows, N]`; the
        product in float32 over the dequantized weight, summed in another order than a GEMM.
        `int8_activations`: of `x` rounded to 8 bits per block of 32 columns (module doc), where
        the kernel takes the weight's layout (int4; int8 in groups of 16 or a multiple of 32 with
        K a multiple of 32); other products as without it."""
        x = x.float()
        if x.stride(-1) != 1:
            x = x.contiguous()
        if bias is not None:
            bias = bias.float().contiguous()
        rows = x.shape[0]
        out = torch.empty((rows, weight.out_features), dtype=torch.float32)
        self._gemv[int8_activations](FORMAT_CODES[weight.format], x.data_ptr(), rows, x.stride(0), weight.values.data_ptr(),
                   weight.scales.data_ptr(), _address(weight.offsets), weight.out_features, weight.in_features,
                   weight.group_size, _address(bias), out.data_ptr(), out.stride(0), torch.get_num_threads())
        return out

    def dequantize(self, weight: QuantizedWeight) -> torch.Tensor:
        """`weight` as a plain float32 `[N, K]` tensor (what `QuantizedWeight.dequantize` computes)."""
        out = torch.empty(weight.shape, dtype=torch.float32)
        self._dequantize(FORMAT_CODES[weight.format], weight.values.data_ptr(), weight.scales.data_ptr(),
                         _address(weight.offsets), weight.out_features, weight.in_features, weight.group_size,
                         out.data_ptr(), torch.get_num_threads())
        return out


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


_library = LazyLibrary("radixserve-quant", SOURCES, COMPILE_FLAGS, REQUIRED_CPU_FLAGS, QuantKernels)
# The library, built on first use; None where it cannot be (then `failure()` says why).
load = _library.load
failure = _library.failure
