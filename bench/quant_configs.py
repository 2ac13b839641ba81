"""The benchmarks' quantization configs: a `--quantization` value (or `gguf`), optionally with
`+head8`, which also gives the LM head an int8 copy (`--lm-head-quantization int8`)."""

from __future__ import annotations

HEAD_INT8 = "head8"


def split_config(config: str) -> tuple[str, str]:
    """(the weights' config, the LM head's quantization) of e.g. `int4+head8`; ValueError for
    another suffix."""
    weights, _, head = config.partition("+")
    if head not in ("", HEAD_INT8):
        raise ValueError(f"{config}: the only suffix is +{HEAD_INT8}")
    return weights, "int8" if head else "none"
