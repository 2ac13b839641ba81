"""GPT-OSS through the whole stack as it is released: `radixserve up` with a tiny random GPT-OSS
whose experts are MXFP4 blocks (`worker/mxfp4_checkpoint.py`), speaking SmolLM2's vocabulary, with
attention sinks in every layer and a window of 8 in its sliding ones. Greedy tokens equal to
transformers' (reading the same file, dequantizing its experts) one chat at a time, all three at
once, and again from the radix cache; the model reports its experts kept as MXFP4's int8."""

from __future__ import annotations

import json
import urllib.request

import pytest

from constrained_model import SMOLLM2_VOCAB_SIZE, with_smollm2_tokenizer
from e2e.parity import check_alone_together_and_cached
from e2e.reference import MAX_NEW_TOKENS, greedy_references
from e2e.stack import launch
from procs import ServiceProcesses
from worker.mxfp4_checkpoint import make_mxfp4_gpt_oss


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, smollm2_dir):
    out_dir = make_mxfp4_gpt_oss(tmp_path_factory.mktemp("gpt-oss-stack"), vocab_size=SMOLLM2_VOCAB_SIZE)
    return with_smollm2_tokenizer(out_dir, smollm2_dir)


@pytest.fixture(scope="module")
def references(gpt_oss_dir):
    return greedy_references(gpt_oss_dir)


@pytest.fixture(scope="module")
def stack(gpt_oss_dir):
    with ServiceProcesses() as procs:
        yield launch(procs, gpt_oss_dir, tp=1, default_max_tokens=MAX_NEW_TOKENS, with_http=True)


@pytest.mark.timeout(300)
def test_gpt_oss_chats_match_transformers_alone_together_and_from_the_cache(stack, references) -> None:
    check_alone_together_and_cached(stack.gateway, references)
    with urllib.request.urlopen(f"{stack.http_base}/v1/models", timeout=10) as response:
        (model,) = json.load(response)["data"]
    assert model["quantization"] == "mxfp4:int8-g32"
