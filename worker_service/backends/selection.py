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

Quantized weights (`--quantization`) are multiplied the way chosen here too, once, with the
backend (`linear_quant.QuantizedLinears`): by the compiled AVX2 kernels on CPU where they build
(their own library: they need no AVX-512), else, and always with `torch` (the reference),
dequantized for each product by PyTorch. The reason the worker logs says which.
`--activation-quantization int8` has the compiled kernels round their activations to 8 bits; it
is refused where they do not run. `auto` (the default) does so for a GGUF file's weights where
they run (llama.cpp, whose files these are, rounds the activations of these products to 8 bits
too), and for nothing else. Where `auto`
falls to PyTorch's ops on CPU (the compiled kernels do not build: no AVX-512) and the quantized
products are compiled, decode steps of a fusable Llama layer run each layer as one compiled call
(`quant_layers_backend.py`: its own AVX2 library); `torch` never does (the reference).

A mixture-of-experts model's experts are computed the way chosen here too (`grouped_experts.py`):
by the compiled grouped product on CPU where it builds (its own AVX2 library) for steps of up to
`COMPILED_MAX_ROWS` rows, else, and always with `torch` (the reference), with quantized weights
(their products are the quantized layers') and under `deterministic`, by one product per expert.

`deterministic` (`--deterministic`) takes PyTorch's ops in their batch- and cache-invariant form
(`invariant_backend.py`) whatever `auto` would have chosen, and refuses what cannot keep that
promise: `native` and `triton` insisted on, CUDA (its Triton kernels split rows by the batch's
shape and no GPU has checked an invariant form of them), and quantized weights (their products
are not checked to be row-invariant).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_service import native, triton_support
from worker_service.attention import triton_decode
from worker_service.backends.base import Backend
from worker_service.backends.grouped_experts import ExpertProducts
from worker_service.backends.invariant_backend import InvariantTorchBackend
from worker_service.backends.linear_quant import QuantizedLinears
from worker_service.backends.native_backend import NativeBackend
from worker_service.backends.quant_layers_backend import QuantLayersBackend
from worker_service.backends.torch_backend import TorchBackend
from worker_service.backends.triton_backend import TritonBackend
from worker_service.native import moe_kernels, quant_layer_kernels
from worker_service.quant import kernels as quant_kernels

KERNEL_CHOICES = ("auto", "native", "torch", "triton")


@dataclass(frozen=True, slots=True)
class Selection:
    """The chosen backend and why it was chosen (what the worker logs)."""

    backend: Backend
    reason: str
    int8_activations: bool = False  # the compiled quantized products round their activations to 8 bits


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


def select_quantized(choice: str, device: torch.device, quantization: str,
                     activations: str = "none") -> tuple[QuantizedLinears, str]:
    """How this worker multiplies `quantization`'s weights (module doc), over activations rounded
    to int8 where `activations` says so (`auto`: for a GGUF file's weights where the compiled
    kernels run), and what to log about it. Raises RuntimeError where int8 activations are asked
    for and the compiled kernels do not run (they alone have them)."""
    if quantization == "none":
        return QuantizedLinears(), ""
    why = "asked for (torch)" if choice == "torch" else None
    if why is None and device.type != "cpu":
        why = f"no compiled kernel on {device.type}"
    kernels = quant_kernels.load() if why is None else None
    if why is None and kernels is None:
        why = quant_kernels.failure()
    if activations == "auto":
        activations = "int8" if quantization == "gguf" and kernels is not None else "none"
    if activations != "none" and kernels is None:
        raise RuntimeError(f"--activation-quantization {activations}: the compiled quantized kernels do not run "
                           f"here ({why})")
    linears = QuantizedLinears(kernels, activations == "int8")
    return linears, f"; {quantization}: {linears.description}" + ("" if why is None else f" ({why})")


def select_experts(choice: str, device: torch.device, quantization: str) -> tuple[ExpertProducts, str]:
    """How this worker computes MoE experts (module doc), and what to log about it: the compiled
    product where taken, why not where it could not be built; nothing where it was not asked for."""
    if choice == "torch" or quantization != "none" or device.type != "cpu":
        return ExpertProducts(), ""
    kernels = moe_kernels.load()
    if kernels is None:
        return ExpertProducts(), f"; MoE experts by per-expert products ({moe_kernels.failure()})"
    experts = ExpertProducts(kernels)
    return experts, f"; {experts.description}"


def select_backend(choice: str, device: torch.device | str, dtype: torch.dtype, head_dim: int,
                   world_size: int = 1, cuda_graph_max_batch: int = 0,
                   ops_without_kernels: tuple[str, ...] = (), quantization: str = "none",
                   deterministic: bool = False, activation_quantization: str = "auto") -> Selection:
    """The backend for `choice` (one of `KERNEL_CHOICES`; see the module doc), multiplying
    `quantization`'s weights as `select_quantized` says. Raises RuntimeError, naming the setting
    and the reason, where an insisted-on backend cannot be used."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"unknown backend {choice!r}; choose from {', '.join(KERNEL_CHOICES)}")
    device = torch.device(device)
    if deterministic:
        return Selection(InvariantTorchBackend(device, dtype), _deterministic_reason(choice, device, quantization))
    quantized, quantized_reason = select_quantized(choice, device, quantization, activation_quantization)
    experts, experts_reason = select_experts(choice, device, quantization)
    selection = _select(choice, device, dtype, head_dim, world_size,
                        0 if ops_without_kernels else cuda_graph_max_batch, quantized, experts)
    reason = selection.reason
    in_torch = [op for op in ops_without_kernels if op not in selection.backend.kernel_ops]
    if in_torch and selection.backend.name != "torch":
        reason += f"; {', '.join(in_torch)} in PyTorch's ops (no kernel of this backend has them)"
    return Selection(selection.backend, reason + quantized_reason + experts_reason, quantized.int8_activations)


def deterministic_refusal(choice: str, device: torch.device, quantization: str) -> str | None:
    """Why `--deterministic` cannot be kept with these settings (module doc), or None."""
    if device.type != "cpu":
        return (f"batch-invariant kernels run on CPU only, not {device.type} (the Triton path splits "
                "its reductions by the batch's shape)")
    if choice in ("native", "triton"):
        return f"--attention-kernel {choice} is not batch-invariant; use auto or torch"
    if quantization != "none":
        return f"--quantization {quantization}: quantized products are not checked to be batch-invariant"
    return None


def _deterministic_reason(choice: str, device: torch.device, quantization: str) -> str:
    why = deterministic_refusal(choice, device, quantization)
    if why is not None:
        raise RuntimeError(f"--deterministic: {why}")
    return f"deterministic: PyTorch's ops in a batch- and cache-invariant order ({choice})"


def _select(choice: str, device: torch.device, dtype: torch.dtype, head_dim: int, world_size: int,
            cuda_graph_max_batch: int, quantized: QuantizedLinears, experts: ExpertProducts) -> Selection:
    refusals = []
    if choice in ("auto", "native"):
        why = native_refusal(device, dtype, head_dim)
        if why is None:
            return Selection(NativeBackend(native.load(), dtype, world_size, quantized, experts),
                             f"compiled kernels for head_dim {head_dim} in {dtype} ({choice})")
        if choice == "native":
            raise RuntimeError(f"--attention-kernel native: {why}")
        refusals.append(f"compiled kernels: {why}")
    if choice in ("auto", "triton"):
        why = triton_refusal(device, dtype, head_dim)
        if why is None:
            graphs = cuda_graph_max_batch if world_size == 1 else 0
            return Selection(TritonBackend(device, dtype, graphs, quantized),
                             f"triton on {device.type} for head_dim {head_dim} in {dtype}, "
                             f"CUDA graphs up to {graphs} rows ({choice})")
        if choice == "triton":
            raise RuntimeError(f"--attention-kernel triton: {why}")
        refusals.append(f"triton: {why}")
    reason = "asked for (torch)" if choice == "torch" else "no other backend runs here: " + "; ".join(refusals)
    if choice == "auto" and device.type == "cpu" and quantized.kernels is not None:
        layer_kernels = quant_layer_kernels.load()
        if layer_kernels is not None:
            return Selection(QuantLayersBackend(layer_kernels, dtype, world_size, quantized, experts),
                             reason + "; decode steps of a Llama layer on one rank by the compiled AVX2 layer")
        reason += f"; no compiled quantized layer ({quant_layer_kernels.failure()})"
    return Selection(TorchBackend(device, dtype, quantized, experts), reason)
