"""Every function of the compiled library (`csrc/`) with its ctypes signature, in one table.

`bind(library)` sets each function's argument and result types from `SIGNATURES`. A function
whose non-zero result means "refused" (`checked`) gets `check_status` as its ctypes `errcheck`: a
bad status becomes a `KernelError` naming the function, so no caller compares statuses itself.
The others return counts or results their callers interpret (the sampling kernels report the
rows they leave to PyTorch that way; `radix_schedule` returns a pointer, null on failure).

The dtype codes are the library's: they are part of its ABI, like the signatures.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

# The library's dtype codes (`kFloat32`, `kBFloat16`, `kFloat16` in the sources).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class KernelError(RuntimeError):
    """A compiled kernel refused its call (a non-zero status)."""


@dataclass(frozen=True, slots=True)
class Signature:
    argtypes: tuple
    restype: type | None = ctypes.c_int
    checked: bool = False  # a non-zero result is an error (see the module doc)


SIGNATURES: dict[str, Signature] = {
    # paged attention (csrc/paged_attention.cpp) and its per-step plan (native/plan.py)
    "radix_supports": Signature((_i32, _i32)),
    "radix_plan_size": Signature((), _i32),
    "radix_schedule": Signature((_ptr,), _ptr),
    "radix_free_schedule": Signature((_ptr,), None),
    "radix_paged_attention": Signature((_ptr,) * 7, checked=True),
    # row-wise ops (csrc/elementwise.cpp, csrc/rope_store.cpp)
    "radix_rms_norm": Signature((_i32, _ptr, _i64, _ptr, _ptr, _i32, _i32, _f32, _i32), checked=True),
    "radix_add_rms_norm": Signature((_i32, _ptr, _ptr, _ptr, _ptr, _i32, _i32, _f32, _i32), checked=True),
    "radix_silu_mul": Signature((_i32, _ptr, _ptr, _i32, _i32, _i32), checked=True),
    "radix_rope_store": Signature((_i32, _ptr, _i64, _i32, _i32, _i32, _i32, *(_ptr,) * 5, _i64, _ptr, _i32),
                                  checked=True),
    # small-batch linear layers (csrc/gemv.cpp) and whole decoder layers (csrc/decode_layer.cpp)
    "radix_gemv_supported": Signature((_i32,)),
    "radix_gemv_packed_size": Signature((_i32, _i64, _i64), _i64),
    "radix_pack_gemv_weight": Signature((_i32, _ptr, _i64, _i64, _ptr), None),
    "radix_gemv": Signature((_i32, _ptr, _i64, _i32, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i32), checked=True),
    "radix_decode_layer": Signature((_ptr, _ptr, _ptr, _ptr, _i32), checked=True),
    # rank 0's sampling (csrc/sample.cpp, penalties.cpp, logprobs.cpp): results, not statuses
    "radix_argmax_rows": Signature((_ptr, _i64, _i32, _i32, _ptr, _i32)),
    "radix_sample_rows": Signature((_ptr, _i64, _i32, _i32, *(_ptr,) * 6, _i32)),
    "radix_apply_penalties": Signature((_ptr, _i64, _i32, _i32, *(_ptr,) * 6, _i32)),
    "radix_logprobs": Signature((_ptr, _i64, _ptr, _i32, _i32, _ptr, _ptr, _i32, _ptr, _ptr, _i32)),
}


def check_status(status: int, function, arguments: tuple) -> int:
    """ctypes `errcheck` of the checked functions: a non-zero status raises `KernelError`."""
    if status != 0:
        raise KernelError(f"{function.__name__} refused the call (status {status})")
    return status


def bind(library: ctypes.CDLL, signatures: dict[str, Signature] | None = None) -> ctypes.CDLL:
    """`library` with every function of `signatures` (default `SIGNATURES`) typed (and checked
    where it says so)."""
    for name, signature in (SIGNATURES if signatures is None else signatures).items():
        function = getattr(library, name)
        function.argtypes = list(signature.argtypes)
        function.restype = signature.restype
        if signature.checked:
            function.errcheck = check_status
    return library
