"""Tensor-parallel linear layers (no autograd: inference only).

Column-parallel splits output features (each rank computes its own slice of the outputs, no
communication); row-parallel splits input features and sums the partial products over the group.
A column-parallel layer may merge several checkpoint projections (q, k, v or gate, up) into one
matrix so that a rank runs one matmul instead of several.

On CPU, weights are repacked once, after loading, into oneDNN's blocked layout
(`pack_linear_weights`). For bfloat16/float16, PyTorch's default CPU matmul is no faster than
float32 for one decode token, while the packed oneDNN kernel (AMX/AVX-512) is 1.5-2x faster at one
row and 2-4x at 32. For float32, plain `aten::mm` (MKL, unpacked) reached 30-150 GFLOP/s on this
project's 2-core machine where the packed oneDNN kernel reached 300-400 at 32-512 rows, and about
1.5x at one row. Results are the same kernel family's (fp32 accumulation).

With the compiled kernels (`worker_service.native`) in bfloat16 on a CPU with AVX512-BF16, each
layer also keeps its weight in the small-batch layout of `csrc/gemv.cpp`, and products of up to
`GEMV_MAX_ROWS` rows (decode steps) use it: oneDNN's kernel costs ~11-20 us per call beyond its
bytes, ~120 calls per step. Measured here, 2 threads, one row: 832 x 576
27 -> 10 us, 3,072 x 576 45 -> 27 us, the 49,152 x 576 LM head 1,406 -> 952 us. The cost is a
second copy of every linear weight in memory. Float32 runs the same kernel (one multiply-add per
lane instead of bfloat16's pairs).

Float16 runs the small-batch kernel too (each weight vector widened to float32 as it is read). On
a CPU without a float16 GEMM (no AVX512-FP16 or AMX-FP16: oneDNN refuses it, and PyTorch's
fallback ran SmolLM2's 512-token prefill at 207 tokens/s here against 1,640 in float32) the larger
products (prefill) multiply in float32: oneDNN's copy of the weight is widened once at `pack`, the
rows are widened before each product and its result rounded back to float16 after, so the
model's activations and KV cache stay float16 and the sums are float32's either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from worker_service.distributed import TPGroup, all_reduce_sum
from worker_service.layers.weights import WeightSlice, make_param

if TYPE_CHECKING:
    from worker_service.native import GemvWeight, NativeKernels

# Products of at most this many rows use the small-batch kernel where a layer has it, the LM head
# included (and the fused decode layer runs for steps of at most this many tokens). It takes the
# rows in passes of up to six over a few output groups at a time, so each weight is read from
# memory once; it beat oneDNN here at every size up to 64 rows (2 threads; 30 layers' four
# products: 8 rows 2.9 vs 5.1 ms, 32 rows 8.7 vs 11.0, 64 rows 16.3 vs 18.5; the 49,152 x 576 LM
# head: 1 row 1,023 vs 1,467 us, 32 rows 3,099 vs 3,418, 64 rows 5,644 vs 5,555), and whole
# bfloat16 decode steps of 128 rows with it up to 128 against 64 (two alternating pairs, medians of
# 15 steps): behind a shared 1,000-token prefix 82.6 / 85.5 -> 71.3 / 69.8 ms, unshared at 1,024
# 139.4 / 141.5 -> 126.0 / 123.7 ms. Larger steps (prefill) keep oneDNN's kernel.
GEMV_MAX_ROWS = 128


def widens_to_float32(weight: torch.Tensor) -> bool:
    """Whether a float16 CPU weight is multiplied in float32 here (no float16 GEMM; module doc)."""
    return (weight.dtype == torch.float16 and weight.device.type == "cpu"
            and not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_fp16_supported()))


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN's packed CPU matmul is available and faster for this weight."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if weight.dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return weight.dtype == torch.float32


class _Linear(torch.nn.Module):
    """x @ weight.T (+ bias), with the weight optionally in oneDNN's packed CPU layout."""

    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None
    packed = False
    gemv: GemvWeight | None = None  # the small-batch kernel's copy of the weight
    kernels: NativeKernels | None = None
    # Float16 without a float16 GEMM: oneDNN's copy (`weight`) is float32, and so is this bias for it
    # (`bias` stays float16 for the small-batch kernel). See the module doc.
    widened = False
    widened_bias: torch.Tensor | None = None

    def pack(self, kernels: NativeKernels | None = None) -> None:
        """Repack the (loaded) weight for oneDNN when this CPU and dtype profit; else no-op. With
        `kernels`, also keep the small-batch kernel's copy where it runs (see the module doc).

        A packed weight is opaque: it can only be multiplied, never read or loaded into again.
        """
        if self.packed:
            return
        if kernels is not None:
            self.gemv = kernels.pack_gemv(self.weight)  # from the plain weight, before oneDNN's
            self.kernels = kernels if self.gemv is not None else None
        if widens_to_float32(self.weight):
            self.weight = torch.nn.Parameter(self.weight.detach().float(), requires_grad=False)
            self.widened_bias = None if self.bias is None else self.bias.detach().float()
            self.widened = True
        if not can_pack(self.weight):
            return
        # A batch-size hint of 1: decode steps are the latency-critical case.
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
        self.weight = torch.nn.Parameter(packed, requires_grad=False)
        self.packed = True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
            return self.kernels.gemv(x, self.gemv, self.bias)
        if self.widened:
            return self._gemm(x.float(), self.widened_bias).to(x.dtype)
        return self._gemm(x, self.bias)

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


class Linear(_Linear):
    """A single-rank linear layer over a given weight: the worker's kernel without a checkpoint
    (the benchmark times GEMM throughput with it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


def pack_linear_weights(model: torch.nn.Module, kernels: NativeKernels | None = None) -> None:
    """Pack every layer of `model` that has a `pack()` method (see the module doc)."""
    for module in model.modules():
        if module is not model and callable(getattr(module, "pack", None)):
            module.pack(kernels)


class ColumnParallelLinear(_Linear):
    """y = x @ W_local.T (+ b_local), where W_local stacks rows of one or more checkpoint matrices.

    `pieces` lists, in output order, `(checkpoint prefix, rows)`: rows `rows` of
    `<prefix>.weight` (and `<prefix>.bias` when `bias`).
    """

    def __init__(
        self,
        input_size: int,
        pieces: list[tuple[str, range]],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.output_sizes = [len(rows) for _, rows in pieces]
        output_size = sum(self.output_sizes)
        self.weight = make_param(
            (output_size, input_size),
            [WeightSlice(f"{prefix}.weight", rows) for prefix, rows in pieces],
            dtype, device,
        )
        self.bias = None
        if bias:
            self.bias = make_param(
                (output_size,),
                [WeightSlice(f"{prefix}.bias", rows) for prefix, rows in pieces],
                dtype, device,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class RowParallelLinear(_Linear):
    """y = sum over ranks of x_local @ W[:, cols_local].T: the input arrives already split."""

    def __init__(
        self,
        prefix: str,
        input_cols: range,
        output_size: int,
        group: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.group = group
        self.weight = make_param(
            (output_size, len(input_cols)), [WeightSlice(f"{prefix}.weight", cols=input_cols)],
            dtype, device,
        )
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(self.matmul(x), self.group)
