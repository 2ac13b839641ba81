"""The benchmarks' quantization configs: `+head8` gives the LM head int8, any other suffix is refused."""

from __future__ import annotations

import pytest

from bench.quant_configs import split_config


def test_head8_and_plain_configs_split_and_other_suffixes_are_refused() -> None:
    assert split_config("int4") == ("int4", "none")
    assert split_config("gguf+head8") == ("gguf", "int8")
    with pytest.raises(ValueError, match=r"int4\+head4: the only suffix is \+head8"):
        split_config("int4+head4")
