"""This machine's bounds, measured in the same run, and what they allow a decode step.

- memory bandwidth: bytes/s of reading a buffer much larger than the caches, the access pattern of
  decode (weights and K/V streamed once per step): the faster of PyTorch's `tensor.sum` and, where
  it runs, the worker's own small-batch linear kernel reading a weight of that size once (it reads
  faster than `sum` here: a bound the code can pass is no bound);
- GEMM throughput per dtype: FLOP/s of a large matmul through the same packed linear kernel the
  worker uses for that dtype.

On CUDA (`device="cuda"`): the read bandwidth of `tensor.sum` over a buffer far past the L2
cache, and the FLOP/s of a large `torch.matmul` (cuBLAS), both timed with CUDA events.

A step's bound is the larger of (bytes it must read / bandwidth) and (FLOPs / GEMM throughput);
a figure divided by its bound's tokens/s says how close the code comes to the machine.
Each measurement is the best of a few tries: the machine is shared, and the best shows the
hardware rather than the neighbours.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from worker_service import native
from worker_service.layers.linear import Linear

BANDWIDTH_BYTES = 512 << 20  # far past any last-level cache
GEMM_SIZE = 1024  # M = N = K: large enough to reach a kernel's steady state
CUDA_BANDWIDTH_BYTES = 4 << 30  # ~80x an H100's L2
CUDA_GEMM_SIZE = 8192  # a GPU's matrix units need large products to fill
TRIES = 5


@dataclass(frozen=True)
class MachineBounds:
    bandwidth_bytes_per_s: float
    gemm_flops_per_s: dict[str, float]  # by dtype name


def _best_seconds(fn, tries: int = TRIES) -> float:
    fn()
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _best_cuda_seconds(fn, tries: int = TRIES) -> float:
    """The fastest of `tries` runs of `fn` on the GPU, timed with CUDA events after a warm-up."""
    fn()
    best = float("inf")
    for _ in range(tries):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def cuda_bounds(dtype_names: list[str]) -> MachineBounds:
    """The GPU's read bandwidth and cuBLAS GEMM throughput per dtype (see the module doc)."""
    buffer = torch.ones(CUDA_BANDWIDTH_BYTES // 2, dtype=torch.bfloat16, device="cuda")
    bandwidth = CUDA_BANDWIDTH_BYTES / _best_cuda_seconds(lambda: buffer.sum(dtype=torch.float32))
    flops = {}
    for name in dtype_names:
        a, b = (torch.randn(CUDA_GEMM_SIZE, CUDA_GEMM_SIZE, device="cuda").to(getattr(torch, name)) for _ in range(2))
        flops[name] = 2 * CUDA_GEMM_SIZE ** 3 / _best_cuda_seconds(lambda: torch.matmul(a, b))
    return MachineBounds(bandwidth, flops)


def memory_bandwidth() -> float:
    """Read bandwidth in bytes/s (see the module doc)."""
    buffer = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    best = BANDWIDTH_BYTES / _best_seconds(buffer.sum)
    del buffer
    kernels = native.load()
    if kernels is not None and torch.bfloat16 in kernels.gemv_dtypes:
        columns = 1024
        weight = kernels.pack_gemv(torch.ones(BANDWIDTH_BYTES // 2 // columns, columns, dtype=torch.bfloat16))
        x = torch.ones(1, columns, dtype=torch.bfloat16)
        best = max(best, weight.packed.numel() * 2 / _best_seconds(lambda: kernels.gemv(x, weight)))
    return best


def gemm_throughput(dtype: torch.dtype) -> float:
    """FLOP/s of a GEMM_SIZE^3 matmul through the worker's (packed, where it packs) linear layer."""
    layer = Linear(torch.randn(GEMM_SIZE, GEMM_SIZE).to(dtype))
    layer.pack()
    x = torch.randn(GEMM_SIZE, GEMM_SIZE).to(dtype)
    with torch.inference_mode():
        return 2 * GEMM_SIZE ** 3 / _best_seconds(lambda: layer(x))


def best_of(a: MachineBounds, b: MachineBounds) -> MachineBounds:
    """The larger of two measurements of each bound."""
    return MachineBounds(max(a.bandwidth_bytes_per_s, b.bandwidth_bytes_per_s),
                         {name: max(flops, b.gemm_flops_per_s.get(name, 0.0)) for name, flops in a.gemm_flops_per_s.items()})


def measure(dtype_names: list[str], device: str = "cpu") -> MachineBounds:
    if device.startswith("cuda"):
        return cuda_bounds(dtype_names)
    return MachineBounds(memory_bandwidth(), {name: gemm_throughput(getattr(torch, name)) for name in dtype_names})


@dataclass(frozen=True)
class StepShape:
    """What one step of a model reads and computes, per token and per context position."""

    weight_bytes: int  # every parameter, read once per step
    matmul_params: int  # parameters that multiply each token (embedding lookups excluded)
    kv_bytes_per_position: int  # K and V of one position, all layers
    attention_flops_per_position: int  # q·k and p·v of one query token against one position


def step_shape(runner) -> StepShape:
    """The shape of `runner`'s model (a worker_service ModelRunner)."""
    config, pool = runner.hf_config, runner.pool
    element = pool.buffer.element_size()
    head_dim = pool.head_dim
    embedding = config.vocab_size * config.hidden_size
    params = sum(p.numel() for p in runner.model.parameters())
    # A quantized weight's parameter holds its packed values (two int4 per byte): count the product's size.
    for module in runner.model.modules():
        quantized = getattr(getattr(module, "packed", None), "quantized", None)
        if quantized is not None:
            params += quantized.out_features * quantized.in_features - module.packed.weight.numel()
    # The LM head multiplies each sampled token; a tied one is the embedding, counted once above.
    matmul_params = params - embedding + (embedding if config.tie_word_embeddings else 0)
    return StepShape(
        weight_bytes=runner.weight_bytes(),
        matmul_params=matmul_params,
        kv_bytes_per_position=2 * pool.num_layers * pool.num_kv_heads * head_dim * element,
        attention_flops_per_position=4 * config.num_hidden_layers * config.num_attention_heads * head_dim,
    )


def decode_bound_tokens_per_s(
    shape: StepShape, bounds: MachineBounds, dtype: str, batch: int, context: int, shared: int = 0
) -> float:
    """Tokens/s of a step of `batch` decode tokens at `context` positions each, `shared` of them
    shared by all (read once), if it ran at the machine's bandwidth or GEMM throughput."""
    positions_read = shared + batch * (context - shared)
    read_s = (shape.weight_bytes + positions_read * shape.kv_bytes_per_position) / bounds.bandwidth_bytes_per_s
    flops = batch * (2 * shape.matmul_params + context * shape.attention_flops_per_position)
    compute_s = flops / bounds.gemm_flops_per_s[dtype]
    return batch / max(read_s, compute_s)


def prefill_bound_tokens_per_s(shape: StepShape, bounds: MachineBounds, dtype: str, length: int) -> float:
    """Tokens/s of one causal prefill of `length` tokens at the GEMM bound (it is compute-bound)."""
    flops = length * 2 * shape.matmul_params + length * length / 2 * shape.attention_flops_per_position
    return length / (flops / bounds.gemm_flops_per_s[dtype])
