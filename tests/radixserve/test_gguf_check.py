"""A GGUF file that cannot be read says why in one line naming the file: empty, not GGUF, or cut
short (where the `gguf` reader alone fails in a reshape), both from the cheap header check and
from `load_config` / `load_tokenizer`, which every service reads the model with."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.gguf_check import gguf_header_problem, gguf_problem
from radixserve.model_source import ModelUnreadable, load_config, load_tokenizer, resolve_model
from worker.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "Q8_0")


def test_the_header_check_finds_empty_and_foreign_files(tmp_path, tiny_gguf):
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "short.gguf").write_bytes(b"GGU")
    (tmp_path / "safetensors.gguf").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    (tmp_path / "v9.gguf").write_bytes(b"GGUF\x09\x00\x00\x00" + bytes(16))
    assert gguf_header_problem(tmp_path / "empty.gguf") == "the file is empty"
    assert "only 3 bytes" in gguf_header_problem(tmp_path / "short.gguf")
    assert "not a GGUF file" in gguf_header_problem(tmp_path / "safetensors.gguf")
    assert "GGUF version 9 is not supported" in gguf_header_problem(tmp_path / "v9.gguf")
    assert gguf_header_problem(tiny_gguf) is None
    assert gguf_problem(tiny_gguf) is None


def test_a_file_cut_short_is_named_with_its_cause(tmp_path, tiny_gguf):
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) * 2 // 3])
    assert gguf_header_problem(cut) is None  # the header is whole: only a full read finds it
    assert gguf_problem(cut) == (f"the file is cut short: it has {len(data) * 2 // 3} bytes, "
                                 f"its tensor data ends at byte {len(data)}")
    with pytest.raises(ModelUnreadable, match=f"cannot read the GGUF file {cut}: the file is cut short"):
        load_config(resolve_model(cut))
    metadata_only = tmp_path / "metadata.gguf"
    metadata_only.write_bytes(data[:40])
    with pytest.raises(ModelUnreadable, match="its metadata cannot be read") as refused:
        load_tokenizer(resolve_model(metadata_only))
    assert "\n" not in str(refused.value)


def test_a_service_that_cannot_read_its_model_exits_with_one_line(tmp_path, tiny_gguf):
    """What the gateway does with a file cut short (`run_service`: its start reads the tokenizer)."""
    from gateway_service.config import PROGRAM
    from radixserve.serving import run_service

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:-100])

    async def start(config):
        load_tokenizer(resolve_model(config.model))

    with pytest.raises(SystemExit) as exited:
        run_service(PROGRAM, start, ["--model", str(cut), "--port", "0", "--http-port", "0"])
    assert exited.value.code == (f"python -m gateway_service: cannot read the GGUF file {cut}: "
                                 "the file is cut short: it has "
                                 f"{cut.stat().st_size} bytes, its tensor data ends at byte {cut.stat().st_size + 100}")


def test_a_file_of_an_architecture_not_served_from_gguf_is_named(tmp_path) -> None:
    """A gpt-oss file (llama.cpp's `*-mxfp4.gguf`): transformers 5.24 fails in its own reading of
    the file's RoPE metadata; the refusal names the architecture and what to serve instead."""
    import gguf

    path = tmp_path / "gpt-oss.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_block_count(1)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(32.0)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_problem(path).startswith("its architecture 'gpt-oss' is not served from GGUF files (served: llama,")
    with pytest.raises(ModelUnreadable, match="'gpt-oss' is not served from GGUF files.*safetensors checkpoint"):
        load_config(resolve_model(path))
