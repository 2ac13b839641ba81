"""K/V go through page tables only: chunking, prefix reuse and physical page ids cannot change logits,
on every backend this machine runs (`backend_params`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.backend_params import backend_params
from worker.tiny_models import VOCAB_SIZE, make_tiny_llama, make_tiny_qwen2
from worker_service.forward_batch import ForwardEntry
from worker_service.kv_pool import KVPool, advise_huge_pages
from worker_service.model_runner import ModelRunner, RunnerConfig

PAGE_SIZE = 4
KV_BYTES = 1 << 20
# Same math in a different order (a causal mask shifted by the chunk start instead of the plain
# causal kernel): fp32 rounding only, measured < 1e-6.
CHUNK_ATOL = 1e-5


@pytest.fixture(scope="module", params=backend_params())
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def runner(request, backend, tmp_path_factory) -> ModelRunner:
    out_dir: Path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    (make_tiny_llama if request.param == "llama" else make_tiny_qwen2)(out_dir)
    runner = ModelRunner(RunnerConfig(model_dir=out_dir, page_size=PAGE_SIZE, kv_cache_bytes=KV_BYTES,
                                      attention_kernel=backend))
    assert runner.backend.name == backend
    return runner


def tokens(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (length,), generator=generator).tolist()


def pages_for(num_tokens: int) -> int:
    return (num_tokens + PAGE_SIZE - 1) // PAGE_SIZE


def last_logits(runner: ModelRunner, token_ids: list[int], page_table: list[int]) -> torch.Tensor:
    return runner.forward([ForwardEntry(token_ids, 0, page_table, True)])[0]


def chunked_logits(
    runner: ModelRunner, token_ids: list[int], page_table: list[int], cuts: list[int]
) -> torch.Tensor:
    """Compute `token_ids` as consecutive chunks ending at each of `cuts`; the last one's logits."""
    start = 0
    for stop in [*cuts, len(token_ids)]:
        logits = runner.forward([ForwardEntry(token_ids[start:stop], start, page_table, stop == len(token_ids))])
        start = stop
    return logits[0]


def test_chunks_give_the_same_logits_as_one_prefill(runner) -> None:
    token_ids = tokens(1, 37)
    whole = last_logits(runner, token_ids, list(range(0, 10)))
    # Chunk boundaries inside pages, on page boundaries, and a one-token chunk (decode path).
    chunked = chunked_logits(runner, token_ids, list(range(10, 20)), [6, 8, 21, 22])
    torch.testing.assert_close(chunked, whole, atol=CHUNK_ATOL, rtol=0)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_chunking_gives_the_same_logits(runner, data) -> None:
    length = data.draw(st.integers(2, 40), label="length")
    cuts = sorted(data.draw(st.sets(st.integers(1, length - 1), max_size=5), label="cuts"))
    token_ids = tokens(length, length)
    whole = last_logits(runner, token_ids, list(range(pages_for(length))))
    chunked = chunked_logits(runner, token_ids, list(range(20, 20 + pages_for(length))), cuts)
    torch.testing.assert_close(chunked, whole, atol=CHUNK_ATOL, rtol=0)


def test_prefix_pages_of_an_earlier_sequence_are_reused_without_recompute(runner) -> None:
    """Y shares X's first 3 pages; Y's entry starts after them and computes only its own tail."""
    shared = tokens(2, 3 * PAGE_SIZE)
    first = shared + tokens(3, 7)
    second = shared + tokens(4, 9)
    first_table = list(range(40, 40 + pages_for(len(first))))
    last_logits(runner, first, first_table)

    second_table = first_table[:3] + list(range(60, 60 + pages_for(len(second)) - 3))
    reused = runner.forward([ForwardEntry(second[len(shared):], len(shared), second_table, True)])[0]
    from_scratch = last_logits(runner, second, list(range(80, 80 + pages_for(len(second)))))
    torch.testing.assert_close(reused, from_scratch, atol=CHUNK_ATOL, rtol=0)

    # The first sequence's pages are intact: it can go on decoding as if nothing happened.
    next_token = 5
    continued = runner.forward([ForwardEntry([next_token], len(first), first_table, True)])[0]
    expected = last_logits(runner, first + [next_token], list(range(100, 100 + pages_for(len(first) + 1))))
    torch.testing.assert_close(continued, expected, atol=CHUNK_ATOL, rtol=0)


def test_shuffled_physical_pages_give_identical_logits(runner) -> None:
    token_ids = tokens(5, 29)
    num_pages = pages_for(len(token_ids) + 3)
    ordered = list(range(num_pages))
    shuffled = torch.randperm(runner.info.num_pages, generator=torch.Generator().manual_seed(5))[:num_pages].tolist()
    results = []
    for page_table in (ordered, shuffled):
        logits = [last_logits(runner, token_ids, page_table)]
        for step, token in enumerate([7, 8, 9]):
            entry = ForwardEntry([token], len(token_ids) + step, page_table, True)
            logits.append(runner.forward([entry])[0])
        results.append(torch.stack(logits))
    assert torch.equal(results[0], results[1])


def test_a_step_writes_only_the_slots_its_page_tables_name(runner) -> None:
    buffer = runner.pool.buffer
    buffer.fill_(float("nan"))  # anything read from outside the table would poison the logits
    first_table, second_table = [7, 3, 11], [2, 9]
    entries = [ForwardEntry(tokens(6, 10), 0, first_table, True), ForwardEntry(tokens(7, 5), 0, second_table, True)]
    logits = runner.forward(entries)
    assert torch.isfinite(logits).all()

    written = ~torch.isnan(buffer).transpose(2, 3).flatten(3).all(-1)  # [2, layers, slots]
    expected = torch.zeros_like(written)
    for table, length in [(first_table, 10), (second_table, 5)]:
        for position in range(length):
            slot = table[position // PAGE_SIZE] * PAGE_SIZE + position % PAGE_SIZE
            expected[:, :, slot] = True
    assert torch.equal(written, expected)
    buffer.zero_()


def test_the_pool_asks_for_huge_pages_and_starts_zeroed() -> None:
    """A pool spanning whole 2 MiB pages is advised (Linux) before its first touch and still reads
    as zeros; memory holding no whole huge page is left alone."""
    pool = KVPool(num_layers=2, num_pages=512, page_size=16, num_kv_heads=2, head_dim=64,
                  dtype=torch.bfloat16, device=torch.device("cpu"))
    assert not bool(pool.buffer.any())
    assert advise_huge_pages(torch.empty(8 << 20, dtype=torch.uint8)) == sys.platform.startswith("linux")
    assert not advise_huge_pages(torch.empty(1024, dtype=torch.uint8))
