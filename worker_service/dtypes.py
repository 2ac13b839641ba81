"""The worker's dtype: the names a user may ask for, and what `auto` resolves to.

`auto` (the default) is bfloat16 where the hardware computes it natively, float32 elsewhere:
- CUDA: bfloat16 (every GPU this project targets has bf16 tensor cores or at least bf16 storage
  with fp32 accumulation in cuBLAS);
- CPU: bfloat16 when the CPU advertises AVX512-BF16 or AMX-BF16 (oneDNN then runs bf16 GEMMs
  natively, about twice float32's speed and half its memory traffic); float32 otherwise, because
  emulated bf16 is slower than float32.

The CPU probe is a plain function of the `/proc/cpuinfo` text so that tests can stub it either way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from radixserve.shared_flags import AUTO_DTYPE as AUTO
from radixserve.shared_flags import DTYPE_NAMES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}
DTYPE_CHOICES = [AUTO, *DTYPES]
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of the first CPU listed in `/proc/cpuinfo` text (empty when absent)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX-BF16)."""
    try:
        text = CPUINFO.read_text()
    except OSError:  # not Linux, or /proc hidden: assume no, float32 is always correct
        return False
    return bool(cpu_flags(text) & NATIVE_BF16_CPU_FLAGS)


def resolve_dtype(name: str, device: str, native_bf16_cpu: Callable[[], bool] | None = None) -> str:
    """The concrete dtype name for `name` on `device` (`auto` resolved, others unchanged).

    `native_bf16_cpu` is the CPU probe (default: `cpu_has_native_bf16`, looked up at call time so
    that tests can replace it). Raises ValueError for a name outside DTYPE_CHOICES.
    """
    if name not in DTYPE_CHOICES:
        raise ValueError(f"unsupported dtype {name!r}; choose from {DTYPE_CHOICES}")
    if name != AUTO:
        return name
    probe = cpu_has_native_bf16 if native_bf16_cpu is None else native_bf16_cpu
    if device.startswith("cuda") or probe():
        return "bfloat16"
    return "float32"
