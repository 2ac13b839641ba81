"""The benchmarks' quantization configs: a `--quantization` value (or `gguf`), optionally with
`+head8`, which also gives the LM head an int8 copy (`--lm-head-quantization int8`), and `+act8`,
which rounds the quantized products' activations to int8 (`--activation-quantization int8`), or
`+exact`, which keeps them float32 (`--activation-quantization none`), in any order
(`gguf+head8+act8`). Without either of the last two a config's activations are what the worker's
default (`auto`) gives it: rounded to int8 for `gguf` where the compiled kernels run, float32
otherwise."""

from __future__ import annotations

from typing import NamedTuple

HEAD_INT8 = "head8"
ACTIVATIONS_INT8 = "act8"
ACTIVATIONS_EXACT = "exact"
SUFFIXES = (HEAD_INT8, ACTIVATIONS_INT8, ACTIVATIONS_EXACT)


class QuantConfig(NamedTuple):
    weights: str  # a `--quantization` value, or `gguf`
    lm_head: str  # `--lm-head-quantization`
    activations: str  # `--activation-quantization`


def split_config(config: str) -> QuantConfig:
    """The settings of e.g. `int4+head8+act8`; ValueError for another suffix, a repeated one, or
    both `+act8` and `+exact`."""
    weights, *suffixes = config.split("+")
    for suffix in suffixes:
        if suffix not in SUFFIXES or suffixes.count(suffix) > 1:
            raise ValueError(f"{config}: the suffixes are {', '.join('+' + s for s in SUFFIXES)}, each once")
    if ACTIVATIONS_INT8 in suffixes and ACTIVATIONS_EXACT in suffixes:
        raise ValueError(f"{config}: +{ACTIVATIONS_INT8} and +{ACTIVATIONS_EXACT} ask for opposite activations")
    activations = ("int8" if ACTIVATIONS_INT8 in suffixes else "none" if ACTIVATIONS_EXACT in suffixes else "auto")
    return QuantConfig(weights, "int8" if HEAD_INT8 in suffixes else "none", activations)
