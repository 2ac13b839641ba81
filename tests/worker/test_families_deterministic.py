"""`--deterministic` holds for every model family, not only the Llama the stack tests run: a
sequence's prompt and decode logits are bit-identical whether it runs alone or between two
others of other lengths (the invariant backend's linear layers, windowed and soft-capped
attention, MoE routing and grouped experts, NoPE layers, a shared expert).

Without the flag the same comparison differs in float32 for every family here (checked when this
was written), so the equalities below are the flag's doing, not the tiny models'.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.families import FAMILIES, VOCAB_SIZE, make_family
from worker_service.forward_batch import ForwardEntry
from worker_service.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.timeout(120)
PAGE_SIZE = 4


def tokens(seed: int, length: int) -> list[int]:
    return torch.randint(3, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def deterministic_runner(model_dir: Path, dtype: str) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=model_dir, page_size=PAGE_SIZE, kv_cache_bytes=1 << 21,
                                    attention_kernel="torch", deterministic=True, dtype=dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_sequence_gets_the_same_bits_alone_and_between_others(family, dtype, tmp_path) -> None:
    model_dir = make_family(family, tmp_path / family)
    mine, before, after = tokens(1, 29), tokens(2, 13), tokens(3, 41)
    my_pages = list(range(0, 12))

    alone = deterministic_runner(model_dir, dtype)
    prompt_alone = alone.forward([ForwardEntry(mine, 0, my_pages, True)])[0]
    decode_alone = alone.forward([ForwardEntry([7], len(mine), my_pages, True)])[0]

    shared = deterministic_runner(model_dir, dtype)
    prompts = shared.forward([ForwardEntry(before, 0, list(range(20, 24)), True),
                              ForwardEntry(mine, 0, my_pages, True),
                              ForwardEntry(after, 0, list(range(30, 42)), True)])
    decodes = shared.forward([ForwardEntry([9], len(before), list(range(20, 24)), True),
                              ForwardEntry([7], len(mine), my_pages, True),
                              ForwardEntry([5], len(after), list(range(30, 42)), True)])
    assert torch.equal(prompts[1], prompt_alone)
    assert torch.equal(decodes[1], decode_alone)
