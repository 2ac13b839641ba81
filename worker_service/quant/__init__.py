"""Quantized weights: the value type and load-time quantizers (`format.py`), `--quantization`
(`scheme.py`), GGUF's and GPTQ/AWQ's layouts mapped onto ours (`gguf_types.py`,
`prequantized.py`) and the compiled AVX2 products (`kernels.py`, `csrc/quant_gemv.cpp`). The packed
linear layers backends return for them are `backends/linear_quant.py`."""

from worker_service.quant.format import QuantizedWeight, quantize_int4, quantize_int8
from worker_service.quant.scheme import GROUP_SIZE_CHOICES, QUANTIZATION_CHOICES, quantizer

__all__ = ["GROUP_SIZE_CHOICES", "QUANTIZATION_CHOICES", "QuantizedWeight", "quantize_int4", "quantize_int8",
           "quantizer"]
