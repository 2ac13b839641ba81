"""Cascade (shared-prefix) decode attention equals plain attention over each sequence's context.

Sequences share token prefixes of random lengths, on and off page boundaries: the router shares
only whole pages, so the shared prefix's full pages are the same physical pages in every table
and the rest of the prefix lies in each sequence's own pages. Page ids are shuffled.
Heads are those of one TP rank of SmolLM2's shape (9 query, 3 KV heads) at TP=1 and TP=2. The
pool is head-major (`[kv_heads, slots, head_dim]`), as the worker's `KVPool` holds it.
"""

from __future__ import annotations

import random

import pytest
import torch

from worker.tiny_models import make_tiny_llama
from worker_service.attention.cascade import decode_attention
from worker_service.attention.decode_plan import plan_decode, shared_prefixes
from worker_service.attention.kernels import GatherSpace
from worker_service.forward_batch import ForwardEntry
from worker_service.layers.sharding import shard_heads
from worker_service.model_runner import ModelRunner, RunnerConfig

HEAD_DIM = 16
NUM_Q_HEADS, NUM_KV_HEADS = 9, 3
# Same math in another order (two partial softmaxes merged by log-sum-exp): fp32 rounding only.
FP32_ATOL = 1e-5
BF16_ATOL = 2e-2


def build_batch(seed: int, page_size: int, num_kv_heads: int, dtype: torch.dtype, head_dim: int = HEAD_DIM):
    """Random groups sharing random token prefixes: (pool K, pool V, tables, context lens, group of each)."""
    rng = random.Random(seed)
    num_groups = rng.randint(1, 4)
    sequences: list[tuple[list[int], int]] = []  # (page table, context len) before page ids are assigned
    group_of: list[int] = []  # each sequence's group
    num_used = 0  # logical pages handed out so far
    for group in range(num_groups):
        prefix_len = rng.choice([page_size * rng.randint(1, 5), rng.randint(1, 5 * page_size)])
        whole = prefix_len // page_size
        group_pages = list(range(num_used, num_used + whole))
        num_used += whole
        for _ in range(rng.randint(1, 5)):
            length = prefix_len + rng.randint(1, 3 * page_size)
            own = list(range(num_used, num_used + -(-length // page_size) - whole))
            num_used += len(own)
            sequences.append((group_pages + own, length))
            group_of.append(group)
    num_pages = num_used + 3  # a few pages no table uses
    physical = list(range(num_pages))
    rng.shuffle(physical)
    generator = torch.Generator().manual_seed(seed)
    # The pool's head-major layout: [kv_heads, slots, head_dim].
    k = torch.randn(num_kv_heads, num_pages * page_size, head_dim, generator=generator).to(dtype)
    v = torch.randn(num_kv_heads, num_pages * page_size, head_dim, generator=generator).to(dtype)
    tables = [[physical[p] for p in table] for table, _ in sequences]
    lens = [length for _, length in sequences]
    return k, v, tables, lens, group_of


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables, lens, page_size) -> torch.Tensor:
    """Plain attention of each row over its own context, slot by slot, in float32."""
    group = q.shape[1] // k.shape[0]
    rows = []
    for row, (table, length) in enumerate(zip(tables, lens)):
        slots = torch.tensor([table[p // page_size] * page_size + p % page_size for p in range(length)])
        keys = k[:, slots].float().repeat_interleave(group, dim=0)  # [Hq, L, D]
        values = v[:, slots].float().repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hld->hl", q[row].float(), keys) * q.shape[-1] ** -0.5
        rows.append(torch.einsum("hl,hld->hd", scores.softmax(-1), values))
    return torch.stack(rows)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("seed", range(6))
def test_cascade_equals_plain_paged_attention(seed: int, page_size: int, world_size: int) -> None:
    for rank in range(world_size):
        heads = shard_heads(NUM_Q_HEADS, NUM_KV_HEADS, world_size, rank)
        k, v, tables, lens, _ = build_batch(seed, page_size, heads.num_kv_heads, torch.float32)
        q = torch.randn(len(tables), heads.num_q_heads, HEAD_DIM, generator=torch.Generator().manual_seed(seed))
        plan = plan_decode(tables, lens, page_size, torch.device("cpu"))
        got = decode_attention(q, k, v, plan, page_size)
        torch.testing.assert_close(got, reference_attention(q, k, v, tables, lens, page_size),
                                   atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_cascade_in_bfloat16_within_dtype_tolerance(seed: int) -> None:
    page_size = 16
    k, v, tables, lens, _ = build_batch(seed, page_size, NUM_KV_HEADS, torch.bfloat16)
    q = torch.randn(len(tables), NUM_Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed))
    plan = plan_decode(tables, lens, page_size, torch.device("cpu"))
    got = decode_attention(q.bfloat16(), k, v, plan, page_size).float()
    torch.testing.assert_close(got, reference_attention(q.bfloat16(), k, v, tables, lens, page_size),
                               atol=BF16_ATOL, rtol=0)


@pytest.mark.parametrize("seed", range(6))
def test_groups_are_found_from_equal_leading_pages(seed: int) -> None:
    page_size = 4
    _, _, tables, lens, group_of = build_batch(seed, page_size, NUM_KV_HEADS, torch.float32)
    groups = shared_prefixes(tables, lens, page_size)
    # Every group of two or more sequences behind at least one whole shared page is found, whole.
    expected = [[row for row, g in enumerate(group_of) if g == group] for group in set(group_of)]
    expected = [rows for rows in expected if len(rows) > 1 and _whole_shared(tables, rows)]
    assert sorted(sorted(rows) for rows, _ in groups) == sorted(expected)
    for rows, num_pages in groups:
        assert all(tables[r][:num_pages] == tables[rows[0]][:num_pages] for r in rows)


def _whole_shared(tables: list[list[int]], rows: list[int]) -> bool:
    """Whether the rows' first pages are one page (their prefix covers at least one whole page)."""
    return len({tables[r][0] for r in rows}) == 1


def _model_dir(family: str, out_dir) -> object:
    from worker.families import make_family

    return make_tiny_llama(out_dir) if family == "llama" else make_family(family, out_dir)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_a_batch_sharing_a_prefix_decodes_as_each_sequence_alone(family, tmp_path, monkeypatch) -> None:
    """Through the model: greedy tokens of 4 sequences behind one 10-token prefix (pages of 4, so
    the prefix ends inside a page) decoded together over the same prefix pages equal each alone.

    Llama and Qwen3 attend the shared pages once per group (the plan's shared prefix is checked);
    Gemma 3's layers (a window of 8, shorter than the sequences) take the windowed path, which
    attends per sequence, and must give the same tokens too."""
    from worker_service.backends import torch_backend

    planned: list[int] = []  # the shared-prefix groups of each decode step's plan

    def spied_plan(*args, **kwargs):
        plan = plan_decode(*args, **kwargs)
        planned.append(len(plan.prefixes))
        return plan

    monkeypatch.setattr(torch_backend, "plan_decode", spied_plan)
    page_size, prefix_len, steps = 4, 10, 6
    runner = ModelRunner(RunnerConfig(model_dir=_model_dir(family, tmp_path / family), page_size=page_size,
                                      kv_cache_bytes=1 << 20, attention_kernel="torch"))
    vocab_size = runner.info.vocab_size
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, vocab_size, (prefix_len,), generator=generator).tolist()
    prompts = [prefix + torch.randint(3, vocab_size, (3 + i,), generator=generator).tolist() for i in range(4)]
    pages_each = -(-(prefix_len + len(prompts) + 3 + steps) // page_size)
    cached = 2 * page_size  # the prefix's whole pages, computed once as the router would cache them
    shared = [40, 7]  # out of order on purpose

    def decode(entries: list[ForwardEntry]) -> list[list[int]]:
        outputs: list[list[int]] = [[] for _ in entries]
        for _ in range(steps):
            next_ids = runner.forward(entries).argmax(-1).tolist()
            entries = [ForwardEntry([t], e.start_position + len(e.token_ids), e.page_table, True)
                       for e, t in zip(entries, next_ids)]
            for out, t in zip(outputs, next_ids):
                out.append(t)
        return outputs

    runner.forward([ForwardEntry(prefix[:cached], 0, shared, False)])
    together = decode([ForwardEntry(p[cached:], cached, shared + [60 + 10 * i + j for j in range(pages_each - 2)], True)
                       for i, p in enumerate(prompts)])
    assert planned == [1] * (steps - 1)  # each decode step of the batch: one group behind the shared pages
    alone = [decode([ForwardEntry(p, 0, [200 + 10 * i + j for j in range(pages_each)], True)])[0]
             for i, p in enumerate(prompts)]
    assert together == alone


def test_a_reused_gather_space_gives_the_results_of_fresh_gathers() -> None:
    """One `GatherSpace` serves batches of every size in turn (it grows, then is reused by smaller
    ones): results equal gathers into fresh tensors bit for bit, so no stale page leaks in."""
    space = GatherSpace()
    for seed in [3, 0, 5, 1]:
        k, v, tables, lens, _ = build_batch(seed, 4, NUM_KV_HEADS, torch.float32)
        q = torch.randn(len(tables), NUM_Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed))
        plan = plan_decode(tables, lens, 4, torch.device("cpu"))
        assert torch.equal(decode_attention(q, k, v, plan, 4, space), decode_attention(q, k, v, plan, 4))


def test_the_gather_space_grows_only_when_asked_for_more() -> None:
    space = GatherSpace()
    like = torch.empty(0, dtype=torch.bfloat16)
    first = space.take(0, 100, like)
    assert space.take(0, 60, like).data_ptr() == first.data_ptr()  # reused, not reallocated
    assert space.take(1, 60, like).data_ptr() != first.data_ptr()  # K and V never share
    grown = space.take(0, 200, like)
    assert grown.numel() == 200 and grown.dtype == torch.bfloat16
    assert space.take(0, 10, torch.empty(0)).dtype == torch.float32  # another dtype: its own buffer
