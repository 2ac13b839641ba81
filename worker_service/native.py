"""The compiled kernels (`csrc/`): built once per machine, called per layer.

`csrc/paged_attention.cpp` attends a whole step, decode rows and prefill spans, in one call per
layer. Decode attention is memory bound: a step reads every running sequence's K/V once per
layer. PyTorch's CPU build has no kernel that reads K/V through page tables, so the torch path
(`cascade.py`) first copies each context into a padded buffer and then runs the flash kernel over
it, a second read at low efficiency with 3 query rows per KV head. This kernel reads each page
where it lies, attends every shared prefix once for all its rows (the same decomposition as
`cascade.py`), splits long contexts across threads and merges partial softmaxes in float32.
Prefill rows read their context (their own new K/V included, written first) the same way, in
tiles of positions with the causal limit applied per row (PyTorch's flash kernel spent 285 ms of
a 6 x 320-token prefill step in a profile here, ~21 GFLOP of causal attention: ~74 GFLOP/s).

`csrc/elementwise.cpp` is RMSNorm for half-precision models in one pass, where PyTorch runs a
chain of eight kernels (bfloat16, 2 threads, rows of 576: 21.6 -> 9.2 us for one row, 826 -> 408
us for 2,048; 61 norms per forward), the residual add fused with the norm after it, and SwiGLU.
`csrc/rope_store.cpp` rotates q and k in place and writes k and v into the pool in one pass, where
the torch path runs a lookup, a roll, three multiplies and adds and two `index_copy_` (bfloat16, 2
threads, SmolLM2's heads: 1 / 32 / 2,048 tokens 23 -> 5, 44 -> 15, 1,279 -> 405 us). Together they
took a bfloat16 decode step of the worker alone (`bench_worker`'s shapes, five alternating pairs,
medians) from 73 to 85 tok/s at batch 1 and from 640 to 738 at batch 32.

`csrc/penalties.cpp`, `csrc/sample.cpp` and `csrc/logprobs.cpp` are rank 0's sampling over float32
logits: penalties, greedy and sampled tokens, logprobs (bound in `native_sampling.py`, used by `sampler.py`).
`csrc/gemv.cpp` multiplies a decode step's rows by a bfloat16 (AVX512-BF16), float32 or float16
weight in its own layout (see `layers/linear.py`); `csrc/decode_layer.cpp` runs a whole decoder layer of such
a step in one call (see `layers/fused_layer.py`). The attention kernel's
per-step plan is `native_plan.py`.

It is built with the machine's C++ compiler (`$CXX`, else `g++`) for the machine's own CPU
(`-march=native`, AVX-512 required) into a cache folder keyed by the source, the compiler and the
CPU's flags, and loaded with ctypes. It uses torch's OpenMP runtime (the same `libgomp.so.1`,
already loaded) with torch's thread count. Where it cannot be built (no compiler, no AVX-512),
`load()` says why and the worker uses the torch path (`--attention-kernel auto`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from worker_service.native_plan import DTYPE_CODES, NativePlan, PlanStruct, build_plan
from worker_service.native_sampling import SamplingKernels

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "elementwise.cpp", CSRC / "rope_store.cpp", CSRC / "gemv.cpp",
           CSRC / "decode_layer.cpp", CSRC / "sample.cpp",
           CSRC / "penalties.cpp", CSRC / "logprobs.cpp"]  # headers beside them are included
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
COMPILE_TIMEOUT_S = 300.0

def _cache_dir() -> Path:
    """Where built kernels are kept: `$RADIXSERVE_KERNEL_CACHE`, else the user's cache folder, else /tmp."""
    configured = os.environ.get("RADIXSERVE_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = base / "radixserve" / "kernels"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"radixserve-kernels-{os.getuid()}"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build(compiler: str | None = None) -> Path:
    """The kernel's shared library, compiled now unless this machine has it cached. Raises on failure."""
    compiler = compiler or os.environ.get("CXX") or "g++"
    path = shutil.which(compiler)
    if path is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} not found; set CXX)")
    version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([*(source.read_text() for source in sorted(CSRC.iterdir())), version,
                                     " ".join(COMPILE_FLAGS), _cpu_flags()])
                         .encode()).hexdigest()[:16]
    folder = _cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / f"radixserve-kernels-{key}.so"
    if library.is_file():
        return library
    # Build beside the target and rename: workers that start together each build, and each
    # rename is atomic, so none loads a half-written file.
    partial = folder / f".radixserve-kernels-{key}-{os.getpid()}.so"
    result = subprocess.run([path, *COMPILE_FLAGS, *map(str, SOURCES), "-o", str(partial)],
                            capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"compiling the kernels failed: {result.stderr.strip()[-2000:]}")
    os.replace(partial, library)
    return library


class NativeKernels:
    """The loaded kernel library."""

    def __init__(self, library: Path) -> None:
        self._lib = ctypes.CDLL(str(library))
        self._lib.radix_supports.argtypes = [ctypes.c_int32, ctypes.c_int32]
        self._lib.radix_plan_size.restype = ctypes.c_int32
        self._attend = self._lib.radix_paged_attention
        self._attend.argtypes = [ctypes.c_void_p] * 6
        self._attend.restype = ctypes.c_int
        self._schedule = self._lib.radix_schedule
        self._schedule.argtypes = [ctypes.c_void_p]
        self._schedule.restype = ctypes.c_void_p
        self._free_schedule = self._lib.radix_free_schedule
        self._free_schedule.argtypes = [ctypes.c_void_p]
        self._rms_norm = self._lib.radix_rms_norm
        self._rms_norm.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_int32, ctypes.c_int32, ctypes.c_float, ctypes.c_int32]
        self._add_rms_norm = self._lib.radix_add_rms_norm
        self._add_rms_norm.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_float, ctypes.c_int32]
        self._silu_mul = self._lib.radix_silu_mul
        self._silu_mul.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                   ctypes.c_int32]
        self._rope_store = self._lib.radix_rope_store
        self._rope_store.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_int32] * 4,
                                     *[ctypes.c_void_p] * 5, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32]
        self._lib.radix_gemv_packed_size.restype = ctypes.c_int64
        self._lib.radix_gemv_packed_size.argtypes = [ctypes.c_int32, ctypes.c_int64, ctypes.c_int64]
        self._lib.radix_pack_gemv_weight.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                     ctypes.c_void_p]
        self._gemv = self._lib.radix_gemv
        self._gemv.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_int32]
        self._lib.radix_gemv_supported.argtypes = [ctypes.c_int32]
        # The dtypes the small-batch linear kernel runs in on this build (bfloat16 needs AVX512-BF16).
        self.gemv_dtypes = frozenset(dtype for dtype in (torch.bfloat16, torch.float32, torch.float16)
                                     if self._lib.radix_gemv_supported(DTYPE_CODES[dtype]))
        self.sampling = SamplingKernels(self._lib)  # rank 0's sampling: see native_sampling.py
        self.decode_layer = self._lib.radix_decode_layer  # see layers/fused_layer.py
        self.decode_layer.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int32]
        self.decode_layer.restype = ctypes.c_int
        if self._lib.radix_plan_size() != ctypes.sizeof(PlanStruct):
            raise RuntimeError("paged_attention.cpp's StepPlan and native_plan.py's mirror differ")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of rows `x` `[..., H]` (last dim contiguous) -> a new `[..., H]`."""
        if x.stride(-1) != 1 or (x.dim() > 2 and not x.is_contiguous()):
            x = x.contiguous()
        size = x.shape[-1]
        rows = x.numel() // size
        out = torch.empty(x.shape, dtype=x.dtype)
        status = self._rms_norm(DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(-2) if x.dim() > 1 else size,
                                weight.data_ptr(), out.data_ptr(), rows, size, eps, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"rms_norm kernel refused the call (status {status})")
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
        status = self._add_rms_norm(DTYPE_CODES[residual.dtype], residual.data_ptr(), delta.data_ptr(),
                                    weight.data_ptr(), out.data_ptr(), residual.numel() // size, size, eps,
                                    torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"add_rms_norm kernel refused the call (status {status})")
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: `silu(gate) * up` of `gate_up` `[T, 2F]` (contiguous, gate first) -> `[T, F]`."""
        if not gate_up.is_contiguous():
            gate_up = gate_up.contiguous()
        rows, features = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, features), dtype=gate_up.dtype)
        status = self._silu_mul(DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), rows, features,
                                torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"silu_mul kernel refused the call (status {status})")
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
        status = self._rope_store(DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.stride(0), tokens, num_q_heads,
                                  num_kv_heads, head_dim, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                  k_slots.data_ptr(), v_slots.data_ptr(), k_slots.stride(0),
                                  write_slots.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"rope_store kernel refused the call (status {status})")

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
        packed = torch.empty(self._lib.radix_gemv_packed_size(code, n, k), dtype=weight.dtype)
        self._lib.radix_pack_gemv_weight(code, weight.data_ptr(), n, k, packed.data_ptr())
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
        status = self._gemv(DTYPE_CODES[dtype], x.data_ptr(), x.stride(0), rows, weight.k, weight.packed.data_ptr(),
                            weight.n, None if bias is None else bias.data_ptr(), out.data_ptr(), weight.n,
                            torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"gemv kernel refused the call (status {status})")
        return out

    def supports(self, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
        return (device.type == "cpu" and dtype in DTYPE_CODES
                and bool(self._lib.radix_supports(head_dim, DTYPE_CODES[dtype])))

    def plan(self, tables: list[list[int]], context_lens: list[int], page_size: int,
             groups: list[tuple[list[int], int]], spans: list[tuple[int, int, int, list[int]]] = ()) -> NativePlan:
        """One step's plan: decode rows 0..len(tables)-1 (page tables and context lengths, the
        groups sharing leading pages), then prefill `spans` as (first row, rows, start position,
        pages up to the last position)."""
        return build_plan(self, tables, context_lens, page_size, groups, spans)

@dataclass(slots=True, frozen=True)
class GemvWeight:
    """A `[n, k]` weight packed for `NativeKernels.gemv` (in `packed`'s dtype)."""

    packed: torch.Tensor
    n: int
    k: int


_loaded: NativeKernels | None = None
_failure: str | None = None


def load() -> NativeKernels | None:
    """The kernel, built and loaded once per process; None (and `failure()` says why) where it cannot be."""
    global _loaded, _failure
    if _loaded is None and _failure is None:
        try:
            _loaded = NativeKernels(build())
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _failure = str(error)
            log.warning("paged attention kernel unavailable, using the torch path: %s", error)
    return _loaded


def failure() -> str | None:
    return _failure


# `triton` is CUDA's decode kernel (`attention/gpu_decode.py`); `auto` picks per device.
KERNEL_CHOICES = ("auto", "native", "torch", "triton")


def select(kind: str, head_dim: int, dtype: torch.dtype, device: torch.device) -> NativeKernels | None:
    """The kernel attention should use for `kind` (`KERNEL_CHOICES`): None means the torch path.

    `auto` takes the compiled kernel where it builds and supports the model's head size and dtype;
    `native` insists on it (raises, saying why, where it cannot be used); `torch` never loads it.
    """
    if kind in ("torch", "triton"):
        return None
    kernel = load() if device.type == "cpu" else None
    if kernel is not None and kernel.supports(head_dim, dtype, device):
        return kernel
    if kind == "native":
        why = (failure() if kernel is None and device.type == "cpu"
               else f"no kernel for head_dim {head_dim}, {dtype}, on {device.type}")
        raise RuntimeError(f"--attention-kernel native: {why}")
    return None
