"""The one place a worker's backend is chosen: from the `--attention-kernel` setting, the device,
the dtype, the model's head size, the TP size and what this machine supports.

`auto` takes the compiled kernels on CPU where they build and support the model's head size and
dtype, Triton on CUDA where it imports and has a kernel for them, and PyTorch's ops otherwise.
`native` and `triton` insist: where they cannot be used, the worker refuses to start and says why.
`torch` always takes PyTorch's ops (the reference the others are tested against). CUDA graphs
come with Triton on a single rank when `cuda_graph_max_batch > 0`.

A model may need operations no kernel has (`CausalLM.ops_without_kernels`: a sliding window, logit
soft-capping, GELU-tanh gating): every backend computes those with PyTorch's ops, the reason says
which, and such a model gets no CUDA graphs (a replayed step does not carry what they read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_service import native, triton_support
from worker_service.attention import triton_decode
from worker_service.backends.base import Backend
from worker_service.backends.native_backend import NativeBackend
from worker_service.backends.torch_backend import TorchBackend
from worker_service.backends.triton_backend import TritonBackend

KERNEL_CHOICES = ("auto", "native", "torch", "triton")


@dataclass(frozen=True, slots=True)
class Selection:
    """The chosen backend and why it was chosen (what the worker logs)."""

    backend: Backend
    reason: str


def native_refusal(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the compiled kernels cannot run this model here, or None where they can."""
    if device.type != "cpu":
        return f"no kernel for head_dim {head_dim}, {dtype}, on {device.type}"
    kernels = native.load()
    if kernels is None:
        return native.failure()
    if not kernels.supports(head_dim, dtype, device):
        return f"no kernel for head_dim {head_dim}, {dtype}, on {device.type}"
    return None


def triton_refusal(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the Triton kernels cannot run this model here, or None where they can."""
    if device.type != "cuda":
        return f"it runs on CUDA only, not {device.type}"
    if not triton_support.available(device):
        return "triton cannot be imported"
    if not triton_decode.supports(head_dim, dtype):
        return f"no kernel for head_dim {head_dim} in {dtype}"
    return None


def select_backend(choice: str, device: torch.device | str, dtype: torch.dtype, head_dim: int,
                   world_size: int = 1, cuda_graph_max_batch: int = 0,
                   ops_without_kernels: tuple[str, ...] = ()) -> Selection:
    """The backend for `choice` (one of `KERNEL_CHOICES`; see the module doc). Raises RuntimeError,
    naming the setting and the reason, where an insisted-on backend cannot be used."""
    selection = _select(choice, torch.device(device), dtype, head_dim, world_size,
                        0 if ops_without_kernels else cuda_graph_max_batch)
    if not ops_without_kernels or selection.backend.name == "torch":
        return selection
    return Selection(selection.backend, f"{selection.reason}; {', '.join(ops_without_kernels)} in PyTorch's "
                                        "ops (no kernel of this backend has them)")


def _select(choice: str, device: torch.device, dtype: torch.dtype, head_dim: int, world_size: int,
            cuda_graph_max_batch: int) -> Selection:
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"unknown backend {choice!r}; choose from {', '.join(KERNEL_CHOICES)}")
    refusals = []
    if choice in ("auto", "native"):
        why = native_refusal(device, dtype, head_dim)
        if why is None:
            return Selection(NativeBackend(native.load(), dtype, world_size),
                             f"compiled kernels for head_dim {head_dim} in {dtype} ({choice})")
        if choice == "native":
            raise RuntimeError(f"--attention-kernel native: {why}")
        refusals.append(f"compiled kernels: {why}")
    if choice in ("auto", "triton"):
        why = triton_refusal(device, dtype, head_dim)
        if why is None:
            graphs = cuda_graph_max_batch if world_size == 1 else 0
            return Selection(TritonBackend(device, dtype, graphs),
                             f"triton on {device.type} for head_dim {head_dim} in {dtype}, "
                             f"CUDA graphs up to {graphs} rows ({choice})")
        if choice == "triton":
            raise RuntimeError(f"--attention-kernel triton: {why}")
        refusals.append(f"triton: {why}")
    reason = "asked for (torch)" if choice == "torch" else "no other backend runs here: " + "; ".join(refusals)
    return Selection(TorchBackend(device, dtype), reason)
