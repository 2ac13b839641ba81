"""The benchmarks' quantization configs: a `--quantization` value (or `gguf`), optionally with
`+head8`, which also gives the LM head an int8 copy (`--lm-head-quantization int8`), and
`+act8`, which rounds the quantized products' activations to int8 (`--activation-quantization
int8`), in either order (`gguf+head8+act8`)."""

from __future__ import annotations

from typing import NamedTuple

HEAD_INT8 = "head8"
ACTIVATIONS_INT8 = "act8"


class QuantConfig(NamedTuple):
    weights: str  # a `--quantization` value, or `gguf`
    lm_head: str  # `--lm-head-quantization`
    activations: str  # `--activation-quantization`


def split_config(config: str) -> QuantConfig:
    """The settings of e.g. `int4+head8+act8`; ValueError for another suffix."""
    weights, *suffixes = config.split("+")
    for suffix in suffixes:
        if suffix not in (HEAD_INT8, ACTIVATIONS_INT8) or suffixes.count(suffix) > 1:
            raise ValueError(f"{config}: the suffixes are +{HEAD_INT8} and +{ACTIVATIONS_INT8}, each once")
    return QuantConfig(weights, "int8" if HEAD_INT8 in suffixes else "none",
                       "int8" if ACTIVATIONS_INT8 in suffixes else "none")
