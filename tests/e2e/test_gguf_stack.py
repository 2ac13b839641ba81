"""A GGUF file through the whole stack: `radixserve up --model tiny.gguf` with a tiny random Llama
in Q4_K_M's mix of types whose metadata carries SmolLM2's tokenizer and chat template (no other
file beside it): greedy chats equal to transformers' reading the same file, token for token and
text for text, and the served quantization named by GetModelInfo. The stack multiplies with float32
activations (`--activation-quantization none`), the exact products transformers' match; what the
default does with a GGUF file's activations is tests/worker/test_gguf.py's."""

from __future__ import annotations

import pytest

from e2e.parity import check_greedy_parity
from e2e.reference import MAX_NEW_TOKENS, greedy_references
from e2e.stack import launch
from procs import ServiceProcesses
from radixserve_client import Client
from worker.tiny_gguf import MIXED, write_tiny_gguf


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory, smollm2_dir):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf-stack") / "tiny-Q4_K_M.gguf", MIXED, smollm2_dir)


@pytest.fixture(scope="module")
def stack(gguf_path):
    with ServiceProcesses() as procs:
        yield launch(procs, gguf_path, tp=1, default_max_tokens=MAX_NEW_TOKENS,
                     extra_args=["--activation-quantization", "none"])


@pytest.mark.timeout(300)
def test_gguf_chats_match_transformers_reading_the_file(stack, gguf_path) -> None:
    for index, reference in enumerate(greedy_references(gguf_path)):
        check_greedy_parity(stack.gateway, index, reference)
    with Client(stack.gateway) as client:
        info = client.model_info(timeout=30)
    assert info.quantization == "gguf:Q4_K+Q6_K"
    assert info.model_name == "tiny-Q4_K_M"
