"""The compiled grouped-expert product (`csrc/moe_experts.cpp`) over torch tensors.

Like the quantized products (`quant/kernels.py`) it is a library of its own, built by
`native.library.build` with AVX2 and FMA only, so it builds on CPUs without AVX-512. `load()`
builds it once per process (None where it cannot be built: no compiler, no AVX2/FMA;
`failure()` says why).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from worker_service.native.library import CSRC, LazyLibrary
from worker_service.native.signatures import Signature, bind

SOURCES = [CSRC / "moe_experts.cpp"]
COMPILE_FLAGS = ["-O3", "-march=native", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
REQUIRED_CPU_FLAGS = ("avx2", "fma")
# The library's weight dtype codes (`kFloat32`, `kBFloat16` in the source).
WEIGHT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
SIGNATURES = {
    "radix_moe_supported": Signature(()),
    "radix_moe_rows_per_pass": Signature((_i32,)),
    "radix_moe_experts": Signature((_i32, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i32,
                                    _ptr, _ptr, _f32, _f32), checked=True),
}


class MoEKernels:
    """The loaded library (`path`), its functions typed by `SIGNATURES`."""

    def __init__(self, path: Path) -> None:
        lib = bind(ctypes.CDLL(str(path)), SIGNATURES)
        if not lib.radix_moe_supported():
            raise RuntimeError("the grouped-expert kernel was built without AVX2 and FMA")
        self._experts = lib.radix_moe_experts
        self._rows_per_pass = lib.radix_moe_rows_per_pass

    def rows_per_pass(self, dtype: torch.dtype) -> int:
        """Rows of one expert that share a pass over its `dtype` weights (8 with AVX-512 BF16's
        pair products for bfloat16, else 4)."""
        return int(self._rows_per_pass(WEIGHT_DTYPES[dtype]))

    def experts(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, clamp: float = 0.0, alpha: float = 1.0) -> torch.Tensor:
        """Rows `hidden` `[T, H]`, each routed to `expert_ids` `[T, top_k]` with `weights`
        `[T, top_k]`, through the stacked experts `gate_up` `[E, 2 I, H]` (gate features first)
        and `down` `[E, H, I]` (contiguous, float32 or bfloat16) -> float32 `[T, H]`: each row's
        sum over its choices of weight * down(silu(gate) * up), in float32 arithmetic. With
        float32 `gate_up_bias` `[E, 2 I]` / `down_bias` `[E, H]` (contiguous) the products add
        them; `clamp` > 0 computes GPT-OSS's clamped SwiGLU with `alpha` in place of SwiGLU."""
        rows, hidden_size = hidden.shape
        num_experts, inter = down.shape[0], down.shape[2]
        if gate_up.shape != (num_experts, 2 * inter, hidden_size) or down.shape[1] != hidden_size:
            raise ValueError(f"expert weights {tuple(gate_up.shape)} and {tuple(down.shape)} do not fit "
                             f"hidden {hidden_size}")
        x = hidden.float().contiguous()
        ids = expert_ids.to(torch.int64).contiguous()
        route = weights.float().contiguous()
        out = torch.empty((rows, hidden_size), dtype=torch.float32)
        for bias, shape in ((gate_up_bias, (num_experts, 2 * inter)), (down_bias, (num_experts, hidden_size))):
            if bias is not None and (bias.dtype != torch.float32 or bias.shape != shape or not bias.is_contiguous()):
                raise ValueError(f"expert biases must be float32 {shape}, contiguous")
        self._experts(WEIGHT_DTYPES[gate_up.dtype], x.data_ptr(), rows, hidden_size, ids.data_ptr(),
                      route.data_ptr(), ids.shape[1], num_experts, gate_up.data_ptr(), down.data_ptr(), inter,
                      out.data_ptr(), torch.get_num_threads(),
                      None if gate_up_bias is None else gate_up_bias.data_ptr(),
                      None if down_bias is None else down_bias.data_ptr(), clamp, alpha)
        return out


_library = LazyLibrary("radixserve-moe", SOURCES, COMPILE_FLAGS, REQUIRED_CPU_FLAGS, MoEKernels)
# The library, built on first use; None where it cannot be (then `failure()` says why).
load = _library.load
failure = _library.failure
