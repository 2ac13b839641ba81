"""A windowed family through the whole stack: `radixserve up` with a tiny random Mistral whose
every layer attends through a window of 32 positions (as Mistral v0.1's 4,096 or Phi-3-mini-4k's
2,047 do), speaking SmolLM2's vocabulary. The chats are 27-37 tokens and run 16 more, so one
starts inside the window and outgrows it while decoding and the others start past it: greedy
tokens equal to transformers' one chat at a time, all three at once (steps that mix sequences
inside and past the window), and again from the radix cache."""

from __future__ import annotations

import pytest

from constrained_model import SMOLLM2_VOCAB_SIZE, with_smollm2_tokenizer
from e2e.parity import check_alone_together_and_cached
from e2e.reference import MAX_NEW_TOKENS, greedy_references
from e2e.stack import launch
from procs import ServiceProcesses
from worker.families import make_family

WINDOW = 32


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, smollm2_dir):
    out_dir = make_family("mistral", tmp_path_factory.mktemp("windowed-stack"), vocab_size=SMOLLM2_VOCAB_SIZE,
                          sliding_window=WINDOW)
    return with_smollm2_tokenizer(out_dir, smollm2_dir)


@pytest.fixture(scope="module")
def references(mistral_dir):
    return greedy_references(mistral_dir)


@pytest.fixture(scope="module")
def stack(mistral_dir):
    with ServiceProcesses() as procs:
        yield launch(procs, mistral_dir, tp=1, default_max_tokens=MAX_NEW_TOKENS)


@pytest.mark.timeout(300)
def test_windowed_chats_match_transformers_alone_together_and_from_the_cache(stack, references) -> None:
    lengths = sorted(len(reference.prompt_ids) for reference in references)
    assert lengths[0] <= WINDOW < lengths[0] + MAX_NEW_TOKENS and lengths[-1] > WINDOW  # both cases are met
    check_alone_together_and_cached(stack.gateway, references)
