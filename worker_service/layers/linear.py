"""Tensor-parallel linear layers (no autograd: inference only).

Column-parallel splits output features (each rank computes its own slice of the outputs, no
communication); row-parallel splits input features and sums the partial products over the group.
A column-parallel layer may merge several checkpoint projections (q, k, v or gate, up) into one
matrix so that a rank runs one matmul instead of several.

After loading, `pack(backend)` hands the weight to the backend, which returns what it multiplies
with (`Backend.pack`: oneDNN's packed layout, the compiled small-batch kernel's, or the plain
weight on CUDA); from then on the layer only calls that. A new weight format is a new packed
form there, not a change here.
"""

from __future__ import annotations

import torch

from worker_service.backends.base import Backend, PackedLinear
from worker_service.backends.linear_quant import pack_row_blocks
from worker_service.backends.linear_torch import TorchLinear
from worker_service.distributed import TPGroup, all_reduce_sum
from worker_service.layers.embedding import ParallelLMHead
from worker_service.layers.weights import WeightSlice, make_param
from worker_service.quant.format import QuantizedWeight
from worker_service.quant.scheme import Quantizer


class PackableLinear(torch.nn.Module):
    """x @ weight.T (+ bias) by the packed weight the backend made (`pack`)."""

    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None
    packed: PackedLinear | None = None
    # Set by a loader that read the weight already quantized (a GGUF file, `gguf_loader.py`; a
    # GPTQ/AWQ checkpoint, `prequantized_loader.py`): its consecutive row blocks, each in one
    # layout, packed as they are in place of `weight`.
    checkpoint_quantized: list[QuantizedWeight] | None = None

    def pack(self, backend: Backend | None = None, quantize: Quantizer | None = None) -> None:
        """Hand the loaded weight (the checkpoint's quantized one where the loader set it, else the
        plain one, quantized by `quantize` where given) to `backend` (None: PyTorch's ops, as
        `TorchBackend`'s) to multiply with from now on; the layer's parameter becomes the packed
        weight, which can only be multiplied, never read or loaded into again."""
        if self.packed is not None:
            return
        weight, bias = self.weight.detach(), None if self.bias is None else self.bias.detach()
        if self.checkpoint_quantized is not None:
            if backend is None:
                raise ValueError("a quantized weight is packed by a backend (Backend.pack)")
            # A loader reads them on the CPU; the layer's weight was made on the model's device.
            blocks = [block.to(weight.device) for block in self.checkpoint_quantized]
            self.adopt(pack_row_blocks(backend.pack, blocks, bias))
            self.checkpoint_quantized = None
        elif quantize is not None:
            if backend is None:
                raise ValueError("a quantized weight is packed by a backend (Backend.pack)")
            self.adopt(backend.pack(quantize(weight), bias))
        else:
            self.adopt(TorchLinear(weight, bias) if backend is None else backend.pack(weight, bias))

    def adopt(self, packed: PackedLinear) -> None:
        """Multiply with `packed` (this layer's weight packed elsewhere, e.g. as a view of a
        layer's stacked experts) from now on; the layer's parameter becomes its weight."""
        self.packed = packed
        self.weight = torch.nn.Parameter(packed.weight, requires_grad=False)


class Linear(PackableLinear):
    """A single-rank linear layer over a given weight: the worker's kernel without a checkpoint
    (the benchmark times GEMM throughput with it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x)


def pack_linear_weights(model: torch.nn.Module, backend: Backend, quantize: Quantizer | None = None,
                        quantize_head: Quantizer | None = None) -> None:
    """Pack every layer of `model` that has a `pack(backend)` method (linear layers, the LM head),
    the decoder layers' linear weights quantized by `quantize` and the LM head by `quantize_head`
    where given."""
    for module in model.modules():
        if isinstance(module, PackableLinear):
            module.pack(backend, quantize)
        elif isinstance(module, ParallelLMHead):
            module.pack(backend, quantize_head)
        elif module is not model and callable(getattr(module, "pack", None)):
            module.pack(backend)


class ColumnParallelLinear(PackableLinear):
    """y = x @ W_local.T (+ b_local), where W_local stacks rows of one or more checkpoint matrices.

    `pieces` lists, in output order, `(checkpoint prefix, rows)`: rows `rows` of
    `<prefix>.weight` (and `<prefix>.bias` when `bias`). A family whose tensors are named
    otherwise gives the slices themselves (`weight_slices`, `bias_slices`: an expert's matrix in a
    3-D tensor, `WeightSlice.expert`), each with its `rows`.
    """

    def __init__(
        self,
        input_size: int,
        pieces: list[tuple[str, range]],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        *,
        weight_slices: list[WeightSlice] | None = None,
        bias_slices: list[WeightSlice] | None = None,
    ) -> None:
        super().__init__()
        if weight_slices is None:
            weight_slices = [WeightSlice(f"{prefix}.weight", rows) for prefix, rows in pieces]
            bias_slices = [WeightSlice(f"{prefix}.bias", rows) for prefix, rows in pieces] if bias else None
        self.output_sizes = [len(piece.rows) for piece in weight_slices]
        output_size = sum(self.output_sizes)
        self.weight = make_param((output_size, input_size), weight_slices, dtype, device)
        self.bias = None if bias_slices is None else make_param((output_size,), bias_slices, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x)


class RowParallelLinear(PackableLinear):
    """y = sum over ranks of x_local @ W[:, cols_local].T (+ b): the input arrives already split.

    With `reduce=False` the layer returns this rank's partial product and the caller sums over the
    group once for several such layers (a mixture of experts adds its experts' outputs first). A
    `bias` (`<prefix>.bias`) is added by rank 0 alone, so that the sum holds it once. `weight` may
    name other slices of the checkpoint than `<prefix>.weight`'s columns (an expert's matrix in a
    3-D tensor: `WeightSlice.expert`)."""

    def __init__(
        self,
        prefix: str,
        input_cols: range,
        output_size: int,
        group: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        reduce: bool = True,
        bias: bool = False,
        weight: WeightSlice | None = None,
        bias_slice: WeightSlice | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.reduce = reduce
        self.weight = make_param(
            (output_size, len(input_cols)), [weight or WeightSlice(f"{prefix}.weight", cols=input_cols)],
            dtype, device,
        )
        self.bias = None
        if bias and group.rank == 0:
            self.bias = make_param((output_size,), [bias_slice or WeightSlice(f"{prefix}.bias")], dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.packed(x)
        return all_reduce_sum(partial, self.group) if self.reduce else partial
