"""Linear layers in PyTorch's ops, with the weight in oneDNN's packed CPU layout where that is faster.

On CPU a weight is repacked once, after loading, into oneDNN's blocked layout: for bfloat16 and
float16 PyTorch's default CPU matmul is no faster than float32, while the packed oneDNN kernel
(AMX/AVX-512) is; for float32 the packed kernel beats plain `aten::mm` too (docs/worker-backends.md
has the figures). Results are the same kernel family's (float32 accumulation).

Float16 on a CPU without a float16 GEMM (no AVX512-FP16 or AMX-FP16: oneDNN refuses it, and
PyTorch's fallback is several times slower than float32) multiplies in float32: the weight is
widened once here, the rows before each product and the result rounded back to float16 after,
so the model's activations and KV cache stay float16 and the sums are float32's either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_service.backends.base import PackedLinear


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


class TorchLinear(PackedLinear):
    """x @ weight.T (+ bias) by PyTorch: oneDNN's packed kernel where `can_pack`, else `F.linear`.

    A packed weight is opaque: it can only be multiplied, never read or loaded into again.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, float32_out: bool = False) -> None:
        self.bias = bias
        self.float32_out = float32_out
        self.widened = widens_to_float32(weight)
        if self.widened:  # the weight and the bias the float32 product adds (`bias` stays for others)
            weight = weight.float()
            self.widened_bias = None if bias is None else bias.float()
        self.packed = can_pack(weight)
        # A batch-size hint of 1: decode steps are the latency-critical case.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.widened:
            out = self._gemm(x.float(), self.widened_bias)
            return out if self.float32_out else out.to(x.dtype)
        return self._gemm(x, self.bias)

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")
        return F.linear(x, self.weight, bias)
