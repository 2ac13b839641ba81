"""Triton, where it can be imported: the one guarded import of the Triton kernels' modules
(`attention/triton_decode.py`, `backends/triton_row_ops.py`) and where they can run.

The CI machine has no Triton: those modules must import anyway, so `triton` and `tl` are None
there and `available` says False.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def interpreting() -> bool:
    """Whether Triton runs its kernels in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    """Whether Triton is importable and can run on `device`: CUDA, or CPU under the interpreter."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())
