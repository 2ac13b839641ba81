"""The compiled kernels a backend calls per layer, over torch tensors (library: `library.py`,
signatures: `signatures.py`).

`csrc/paged_attention.cpp` attends a whole step, decode rows and prefill spans, in one call per
layer, reading each page where it lies (no gather into a padded buffer), attending every shared
prefix once for all its rows (the decomposition of `attention/cascade.py`), splitting long
contexts across threads and merging partial softmaxes in float32; its per-step plan is `plan.py`.
`csrc/elementwise.cpp` is RMSNorm in one pass, the residual add fused with the norm after it, and
SwiGLU; `csrc/rope_store.cpp` rotates q and k in place and writes k and v into the pool in one pass.
`csrc/gemv.cpp` multiplies a decode step's rows by a weight in its own layout (`pack_gemv`);
`csrc/decode_layer.cpp` runs a whole Llama decoder layer of such a step in one call
(`backends/fused_llama.py`). Rank 0's sampling kernels are bound in `worker_service/sampling/`.
What each of these saves, measured, is in docs/worker-backends.md.

Every call that can be refused raises `signatures.KernelError` (a RuntimeError).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from worker_service.native.library import build, cpu_flags, open_library
from worker_service.native.plan import NativePlan, PlanStruct, build_plan
from worker_service.native.signatures import DTYPE_CODES

log = logging.getLogger(__name__)


class NativeKernels:
    """The loaded kernel library."""

    def __init__(self, library: Path) -> None:
        # Public: the attention plan (`plan.py`), the fused layers and the sampling bindings call
        # the library's typed functions (`signatures.py`) directly.
        self.lib = open_library(library)
        lib = self.lib
        self._rms_norm, self._add_rms_norm = lib.radix_rms_norm, lib.radix_add_rms_norm
        self._silu_mul, self._rope_store, self._gemv = lib.radix_silu_mul, lib.radix_rope_store, lib.radix_gemv
        # The dtypes the small-batch linear kernel runs in on this build (bfloat16 needs AVX512-BF16).
        self.gemv_dtypes = frozenset(dtype for dtype in (torch.bfloat16, torch.float32, torch.float16)
                                     if lib.radix_gemv_supported(DTYPE_CODES[dtype]))
        if lib.radix_plan_size() != ctypes.sizeof(PlanStruct):
            raise RuntimeError("paged_attention.cpp's StepPlan and native/plan.py's mirror differ")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of rows `x` `[..., H]` (last dim contiguous) -> a new `[..., H]`."""
        if x.stride(-1) != 1 or (x.dim() > 2 and not x.is_contiguous()):
            x = x.contiguous()
        size = x.shape[-1]
        rows = x.numel() // size
        out = torch.empty(x.shape, dtype=x.dtype)
        self._rms_norm(DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(-2) if x.dim() > 1 else size,
                       weight.data_ptr(), out.data_ptr(), rows, size, eps, torch.get_num_threads())
        return out

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """`residual += delta` (in place, rounded to the dtype), then RMSNorm of it -> a new tensor.

        Both `[T, H]` contiguous of the same dtype.
        """
        if not (residual.is_contiguous() and delta.is_contiguous() and residual.shape == delta.shape):
            raise ValueError("add_rms_norm needs two contiguous tensors of one shape")
        size = residual.shape[-1]
        out = torch.empty_like(residual)
        self._add_rms_norm(DTYPE_CODES[residual.dtype], residual.data_ptr(), delta.data_ptr(),
                           weight.data_ptr(), out.data_ptr(), residual.numel() // size, size, eps,
                           torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: `silu(gate) * up` of `gate_up` `[T, 2F]` (contiguous, gate first) -> `[T, F]`."""
        if not gate_up.is_contiguous():
            gate_up = gate_up.contiguous()
        rows, features = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, features), dtype=gate_up.dtype)
        self._silu_mul(DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), rows, features,
                       torch.get_num_threads())
        return out

    def rope_store(self, qkv: torch.Tensor, num_q_heads: int, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                   write_slots: torch.Tensor) -> None:
        """Rotate the query and key heads of `qkv` `[T, Hq + 2 Hk, D]` in place and store its keys and
        values into `k_slots` / `v_slots` (`[Hk, num_slots, D]`, head-major) at `write_slots` `[T]`.

        `cos` / `sin` are `RotaryEmbedding`'s whole tables `[max_positions, D]`, looked up at
        `positions` `[T]` (int64, as `write_slots`); `qkv`'s last two dims must be contiguous.
        """
        tokens, heads, head_dim = qkv.shape
        num_kv_heads = k_slots.shape[0]
        if heads != num_q_heads + 2 * num_kv_heads or qkv.stride(2) != 1 or qkv.stride(1) != head_dim:
            raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_q_heads} + 2 x {num_kv_heads} heads")
        if not (positions.dtype == write_slots.dtype == torch.int64 and positions.is_contiguous()
                and write_slots.is_contiguous() and len(positions) == len(write_slots) == tokens):
            raise ValueError("positions and write slots must be contiguous int64, one per token")
        if not (cos.is_contiguous() and sin.is_contiguous() and cos.shape[-1] == sin.shape[-1] == head_dim
                and k_slots.stride(2) == 1
                and k_slots.stride(1) == head_dim and k_slots.stride() == v_slots.stride()):
            raise ValueError("rope tables and KV slots must be contiguous per head")
        self._rope_store(DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.stride(0), tokens, num_q_heads,
                         num_kv_heads, head_dim, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                         k_slots.data_ptr(), v_slots.data_ptr(), k_slots.stride(0),
                         write_slots.data_ptr(), torch.get_num_threads())

    def pack_gemv(self, weight: torch.Tensor) -> GemvWeight | None:
        """`weight` `[N, K]` (bfloat16, float32 or float16, CPU) in the small-batch linear's
        layout (`csrc/gemv.cpp`), or None where that kernel does not run (bfloat16 without
        AVX512-BF16 or with an odd K)."""
        if weight.dtype not in self.gemv_dtypes or weight.dim() != 2:
            return None
        if weight.dtype == torch.bfloat16 and weight.shape[1] % 2:
            return None
        n, k = weight.shape
        code = DTYPE_CODES[weight.dtype]
        weight = weight.detach().contiguous()
        packed = torch.empty(self.lib.radix_gemv_packed_size(code, n, k), dtype=weight.dtype)
        self.lib.radix_pack_gemv_weight(code, weight.data_ptr(), n, k, packed.data_ptr())
        return GemvWeight(packed, n, k)

    def gemv(self, x: torch.Tensor, weight: GemvWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x` `[rows, K]` (the weight's dtype, last dim contiguous) times the packed weight's
        transpose (+ `bias`) -> `[rows, N]`, the weight read from memory once."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        dtype = weight.packed.dtype
        if x.dtype != dtype or (bias is not None and bias.dtype != dtype):
            raise TypeError(f"gemv of a {dtype} weight got {x.dtype} rows"
                            + ("" if bias is None else f" and a {bias.dtype} bias"))
        rows = x.shape[0]
        out = torch.empty((rows, weight.n), dtype=dtype)
        self._gemv(DTYPE_CODES[dtype], x.data_ptr(), x.stride(0), rows, weight.k, weight.packed.data_ptr(),
                   weight.n, None if bias is None else bias.data_ptr(), out.data_ptr(), weight.n,
                   torch.get_num_threads())
        return out

    def supports(self, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
        return (device.type == "cpu" and dtype in DTYPE_CODES
                and bool(self.lib.radix_supports(head_dim, DTYPE_CODES[dtype])))

    def plan(self, tables: list[list[int]], context_lens: list[int], page_size: int,
             groups: list[tuple[list[int], int]], spans: list[tuple[int, int, int, list[int]]] = ()) -> NativePlan:
        """One step's plan: decode rows 0..len(tables)-1 (page tables and context lengths, the
        groups sharing leading pages), then prefill `spans` as (first row, rows, start position,
        pages up to the last position)."""
        return build_plan(self.lib, tables, context_lens, page_size, groups, spans)

@dataclass(slots=True, frozen=True)
class GemvWeight:
    """A `[n, k]` weight packed for `NativeKernels.gemv` (in `packed`'s dtype)."""

    packed: torch.Tensor
    n: int
    k: int


_loaded: NativeKernels | None = None
_failure: str | None = None


def load() -> NativeKernels | None:
    """The kernels, built and loaded once per process; None (and `failure()` says why) where they cannot be."""
    global _loaded, _failure
    if _loaded is None and _failure is None:
        if "avx512f" not in cpu_flags().split():
            # Every source refuses to compile without it (#error); asking the compiler would only
            # spend half a minute of each worker's start to learn that.
            _failure = "this CPU has no AVX-512 (avx512f), which the compiled kernels need"
            log.info("the compiled kernels are unavailable: %s", _failure)
            return None
        try:
            _loaded = NativeKernels(build())
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _failure = str(error)
            log.warning("the compiled kernels are unavailable: %s", error)
    return _loaded


def failure() -> str | None:
    """Why `load()` returned None (None before it was called or where it succeeded)."""
    return _failure
