"""The benchmarks' quantization configs: `+head8` gives the LM head int8, `+act8` the quantized
products' activations, `+exact` keeps those float32, no activation suffix leaves them to the
worker's default (`auto`); any other suffix, one twice, or both `+act8` and `+exact` is refused."""

from __future__ import annotations

import pytest

from bench.quant_configs import split_config


def test_head8_act8_exact_and_plain_configs_split_and_other_suffixes_are_refused() -> None:
    assert split_config("int4") == ("int4", "none", "auto")
    assert split_config("gguf+head8") == ("gguf", "int8", "auto")
    assert split_config("gguf+act8+head8") == ("gguf", "int8", "int8")
    assert split_config("int4+act8").activations == "int8"
    assert split_config("gguf+exact") == ("gguf", "none", "none")
    for bad in ("int4+head4", "int4+act8+act8"):
        with pytest.raises(ValueError, match=r"the suffixes are \+head8, \+act8, \+exact, each once"):
            split_config(bad)
    with pytest.raises(ValueError, match="opposite activations"):
        split_config("gguf+act8+exact")
