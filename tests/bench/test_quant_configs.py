"""The benchmarks' quantization configs: `+head8` gives the LM head int8, `+act8` the quantized
products' activations, any other suffix (or one twice) is refused."""

from __future__ import annotations

import pytest

from bench.quant_configs import split_config


def test_head8_act8_and_plain_configs_split_and_other_suffixes_are_refused() -> None:
    assert split_config("int4") == ("int4", "none", "none")
    assert split_config("gguf+head8") == ("gguf", "int8", "none")
    assert split_config("gguf+act8+head8") == ("gguf", "int8", "int8")
    assert split_config("int4+act8").activations == "int8"
    for bad in ("int4+head4", "int4+act8+act8"):
        with pytest.raises(ValueError, match=r"the suffixes are \+head8 and \+act8, each once"):
            split_config(bad)
