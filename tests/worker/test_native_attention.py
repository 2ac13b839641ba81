"""The compiled paged attention kernel (`worker_service/native/`) equals plain attention over each context.

Batches come from the cascade test's builder: groups of sequences sharing token prefixes of random
lengths (whole shared pages are the same physical pages, page ids shuffled). The kernel reads K/V
through the page tables with no gather, attends each shared prefix once for its group, and splits
long contexts across threads; every path is checked against attention of each row alone, in
float32, for each pool dtype, head size, page size and thread count. Through the model, greedy
tokens with the kernel equal those of the torch path. The library's RMSNorm equals the layer's
PyTorch ops within one step of the half-precision dtype.
"""

from __future__ import annotations

import random

import pytest
import torch

from worker import test_cascade_attention as cascade
from worker.tiny_models import VOCAB_SIZE, make_tiny_llama
from worker_service import native
from worker_service.attention.decode_plan import shared_prefixes
from worker_service.forward_batch import ForwardEntry
from worker_service.backends import select_backend
from worker_service.backends.torch_backend import TorchBackend
from worker_service.layers.norm import RMSNorm
from worker_service.layers.sharding import shard_heads
from worker_service.model_runner import ModelRunner, RunnerConfig

KERNEL = native.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"the kernel does not build here: {native.failure()}")
CPU = torch.device("cpu")
# Output rounding to the pool's dtype dominates: one bfloat16 step near 1 is 2^-7.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
# Float32 sums taken in other orders than the reference's err by a few steps of the result's own
# magnitude: up to 6.3 float32 epsilons of a value near 2.9 (2.1e-6) against a float64 reference,
# where the root-mean-square error over test_kernel_equals_attention_of_each_row_alone's cases
# is 8.7e-8 (8.6e-8 before the float32 many-query path); so float32 also allows 2.5 epsilons of
# the expected value.
RELATIVE = {torch.float32: 3e-7, torch.bfloat16: 0.0, torch.float16: 0.0}


reference = cascade.reference_attention  # plain float32 attention of each row over its own context


def batch(seed: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    k, v, tables, lens, _ = cascade.build_batch(seed, page_size, num_kv_heads, dtype, head_dim)
    return k, v, tables, lens


def attend(q, k, v, tables, lens, page_size: int) -> torch.Tensor:
    """Decode rows only, grouped by shared leading pages as the model runner groups them."""
    return KERNEL.plan(tables, lens, page_size, shared_prefixes(tables, lens, page_size)).attend(q, k, v)


def group_behind_prefix(rng: random.Random, num_rows: int, prefix_pages: int, max_own: int,
                        page_size: int) -> tuple[list[int], list[list[int]], list[int], int]:
    """`num_rows` rows behind pages 0..prefix_pages-1 plus 1..max_own keys each: (prefix, tables,
    context lens, next free page)."""
    prefix = list(range(prefix_pages))
    tables, lens, next_page = [], [], prefix_pages
    for _ in range(num_rows):
        length = prefix_pages * page_size + rng.randint(1, max_own)
        own = -(-length // page_size) - prefix_pages
        tables.append(prefix + list(range(next_page, next_page + own)))
        next_page += own
        lens.append(length)
    return prefix, tables, lens, next_page


def attend_with_spans(q, k, v, tables, lens, spans, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows and prefill `spans` (first row, rows, start, pages) in one call, and the
    reference: each span row attends its pages up to its own position."""
    plan = KERNEL.plan(tables, lens, page_size, shared_prefixes(tables, lens, page_size), spans)
    span_tables = [table for _, count, start, table in spans for _ in range(count)]
    span_lens = [position + 1 for _, count, start, _ in spans for position in range(start, start + count)]
    return plan.attend(q, k, v).float(), reference(q, k, v, tables + span_tables, lens + span_lens, page_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("page_size", [3, 4, 16])  # 3: pages end on odd keys (the pair paths' tails)
@pytest.mark.parametrize("seed", range(4))
def test_kernel_equals_attention_of_each_row_alone(seed, page_size, head_dim, dtype, threads) -> None:
    # SmolLM2's heads (9 query, 3 KV) as each rank holds them at TP=1 and TP=2.
    shares = [shard_heads(9, 3, world_size, rank) for world_size in (1, 2) for rank in range(world_size)]
    for num_q_heads, num_kv_heads in sorted({(s.num_q_heads, s.num_kv_heads) for s in shares}):
        k, v, tables, lens = batch(seed, page_size, num_kv_heads, head_dim, dtype)
        q = torch.randn(len(tables), num_q_heads, head_dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
        got = attend(q, k, v, tables, lens, page_size)
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), reference(q, k, v, tables, lens, page_size),
                                   atol=TOLERANCE[dtype], rtol=RELATIVE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_contexts_and_large_groups(dtype, threads) -> None:
    """Contexts of thousands of keys (cut into chunks whose partials are merged), a group of 40
    rows behind one 1,000-token prefix (more queries than fit in registers at once), rows alone,
    and contexts that end on and off page boundaries, in one batch."""
    page_size, head_dim, num_kv_heads, num_q_heads = 16, 64, 3, 9
    rng = random.Random(7)
    _, tables, lens, next_page = group_behind_prefix(rng, 40, 62, 40, page_size)  # 992 tokens shared
    for length in [3000, 1, 16, 2048 + 5]:
        own = -(-length // page_size)
        tables.append(list(range(next_page, next_page + own)))
        next_page += own
        lens.append(length)
    order = list(range(len(tables)))
    rng.shuffle(order)  # members of the group need not be adjacent rows
    tables, lens = [tables[i] for i in order], [lens[i] for i in order]
    generator = torch.Generator().manual_seed(1)
    k = torch.randn(num_kv_heads, next_page * page_size, head_dim, generator=generator).to(dtype)
    v = torch.randn(num_kv_heads, next_page * page_size, head_dim, generator=generator).to(dtype)
    q = torch.randn(len(tables), num_q_heads, head_dim, generator=generator).to(dtype)
    got = attend(q, k, v, tables, lens, page_size)
    torch.testing.assert_close(got.float(), reference(q, k, v, tables, lens, page_size),
                               atol=TOLERANCE[dtype], rtol=RELATIVE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_prefill_spans_attend_causally_beside_decode_rows(seed, dtype, threads) -> None:
    """One call for a step's every row: decode rows, then prefill spans (a prompt from position
    0, chunks continuing a context, one row, more than a tile of rows, starts on and off page
    boundaries); each span row sees exactly the keys up to its own position."""
    page_size, head_dim, num_kv_heads, num_q_heads = 4, 64, 3, 9
    rng = random.Random(seed)
    k, v, tables, lens = batch(seed, page_size, num_kv_heads, head_dim, dtype)
    num_decode = len(tables)
    num_pages = k.shape[1] // page_size
    spans = []  # (first row, rows, start, pages)
    next_page, row = num_pages, num_decode
    for start, count in [(0, rng.randint(2, 90)), (rng.randint(1, 40), rng.randint(1, 40)), (8, 1),
                         (rng.randint(1, 9) * page_size, rng.randint(30, 70))]:
        end = start + count
        table = list(range(next_page, next_page + -(-end // page_size)))
        next_page += len(table)
        spans.append((row, count, start, table))
        row += count
    generator = torch.Generator().manual_seed(seed)
    grow = (next_page - num_pages) * page_size
    k = torch.cat([k, torch.randn(num_kv_heads, grow, head_dim, generator=generator).to(dtype)], 1)
    v = torch.cat([v, torch.randn(num_kv_heads, grow, head_dim, generator=generator).to(dtype)], 1)
    q = torch.randn(row, num_q_heads, head_dim, generator=generator).to(dtype)
    got, expected = attend_with_spans(q, k, v, tables, lens, spans, page_size)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=RELATIVE[dtype])


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(8, 1, 128), (12, 2, 96), (4, 2, 32)])
def test_wide_query_groups_in_every_tile_shape(num_q_heads, num_kv_heads, head_dim, threads) -> None:
    """Models with more query heads per KV head than SmolLM2: a decode group of 20 rows behind a
    shared prefix (160 / 120 / 40 queries per KV head: blocks of 4, 3, 2 and 1 vectors of 16) and
    prefill spans of 1 to 40 rows behind cached tokens and from position 0, in bfloat16."""
    dtype, page_size = torch.bfloat16, 16
    rng = random.Random(num_q_heads)
    prefix, tables, lens, next_page = group_behind_prefix(rng, 20, 13, 50, page_size)  # 208 tokens shared
    spans, row = [], len(tables)
    for start, count in [(0, 40), (208, 1), (208, 17), (100, 33)]:  # the last within the prefix's pages
        own = max(0, -(-(start + count) // page_size) - len(prefix))
        spans.append((row, count, start, prefix + list(range(next_page, next_page + own))))
        next_page += own
        row += count
    generator = torch.Generator().manual_seed(num_q_heads)
    k = torch.randn(num_kv_heads, next_page * page_size, head_dim, generator=generator).to(dtype)
    v = torch.randn(num_kv_heads, next_page * page_size, head_dim, generator=generator).to(dtype)
    q = torch.randn(row, num_q_heads, head_dim, generator=generator).to(dtype)
    got, expected = attend_with_spans(q, k, v, tables, lens, spans, page_size)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=RELATIVE[dtype])


def test_queries_may_be_a_strided_view() -> None:
    """The model hands decode queries as a slice of the merged q/k projection (rows further apart
    than one row's heads): the kernel reads them where they are."""
    k, v, tables, lens = batch(3, 4, 3, 64, torch.float32)
    merged = torch.randn(len(tables) + 2, 9 + 3, 64)
    q = merged[: len(tables), :9]
    assert not q.is_contiguous()
    torch.testing.assert_close(attend(q, k, v, tables, lens, 4), reference(q, k, v, tables, lens, 4),
                               atol=TOLERANCE[torch.float32], rtol=RELATIVE[torch.float32])


def test_one_plan_serves_every_layer_and_rebinds_for_another_layout() -> None:
    """A step's plan is built once and called per layer: repeated calls give the result of a fresh
    plan, and a call whose q is laid out differently (rows further apart) rebuilds its schedule."""
    k, v, tables, lens = batch(5, 16, 3, 64, torch.bfloat16)
    plan = KERNEL.plan(tables, lens, 16, shared_prefixes(tables, lens, 16))
    q = torch.randn(len(tables), 9, 64).bfloat16()
    first = plan.attend(q, k, v)
    assert torch.equal(plan.attend(q, k, v), first)
    wide = torch.cat([q, torch.zeros(len(tables), 3, 64, dtype=torch.bfloat16)], 1)  # rows 12 heads apart
    assert torch.equal(plan.attend(wide[:, :9], k, v), first)
    assert torch.equal(plan.attend(q, k, v), first)


def test_greedy_tokens_equal_the_torch_path(tmp_path) -> None:
    """Through the tiny model: 4 sequences behind a 10-token prefix (pages of 4), decoded together
    with the kernel and with the torch path, give the same greedy tokens and close logits."""
    model_dir = make_tiny_llama(tmp_path)
    page_size, steps = 4, 6
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, VOCAB_SIZE, (10,), generator=generator).tolist()
    prompts = [prefix + torch.randint(3, VOCAB_SIZE, (3 + i,), generator=generator).tolist() for i in range(4)]

    def run(kernel: str) -> tuple[list[list[int]], torch.Tensor]:
        runner = ModelRunner(RunnerConfig(model_dir=model_dir, page_size=page_size, kv_cache_bytes=1 << 20,
                                          attention_kernel=kernel))
        assert (runner.backend.name == "native") == (kernel == "native")
        shared = [40, 7]
        runner.forward([ForwardEntry(prefix[:8], 0, shared, False)])
        entries = [ForwardEntry(p[8:], 8, shared + [60 + 10 * i + j for j in range(6)], True)
                   for i, p in enumerate(prompts)]
        outputs: list[list[int]] = [[] for _ in entries]
        all_logits = []
        for _ in range(steps):
            logits = runner.forward(entries)
            all_logits.append(logits)
            next_ids = logits.argmax(-1).tolist()
            entries = [ForwardEntry([t], e.start_position + len(e.token_ids), e.page_table, True)
                       for e, t in zip(entries, next_ids)]
            for out, t in zip(outputs, next_ids):
                out.append(t)
        return outputs, torch.stack(all_logits)

    native_tokens, native_logits = run("native")
    torch_tokens, torch_logits = run("torch")
    assert native_tokens == torch_tokens
    torch.testing.assert_close(native_logits, torch_logits, atol=1e-4, rtol=0)


def test_native_is_refused_with_the_reason_where_it_cannot_build(monkeypatch) -> None:
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        native.build(compiler="no-such-compiler-radixserve")
    monkeypatch.setattr(native.kernels, "_loaded", None)
    monkeypatch.setattr(native.kernels, "_failure", "no C++ compiler (stubbed)")
    with pytest.raises(RuntimeError, match="--attention-kernel native: no C\\+\\+ compiler"):
        select_backend("native", CPU, torch.float32, 64)
    assert select_backend("auto", CPU, torch.float32, 64).backend.name == "torch"  # auto falls back to torch
    monkeypatch.undo()
    assert select_backend("torch", CPU, torch.float32, 64).backend.name == "torch"
    chosen = select_backend("auto", CPU, torch.float32, 64).backend
    assert chosen.name == "native" and chosen.kernels is KERNEL
    assert select_backend("auto", CPU, torch.float32, 40).backend.name == "torch"  # a head size it has no code for
    with pytest.raises(RuntimeError, match="no kernel for head_dim 40"):
        select_backend("native", CPU, torch.float32, 40)


def test_a_built_kernel_is_reused_from_the_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RADIXSERVE_KERNEL_CACHE", str(tmp_path))
    first = native.build()
    assert first.parent == tmp_path and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial file left behind


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows,size", [(1, 576), (37, 576), (300, 100), (5, 16)])
def test_rms_norm_kernel_equals_the_torch_layer(rows, size, dtype, threads) -> None:
    """The compiled RMSNorm against the layer's PyTorch ops (the reference Llama rounding): at most
    one step of the dtype apart (the sum of squares is taken in another order), nearly always equal;
    a strided input (rows of a wider tensor) is read where it is."""
    generator = torch.Generator().manual_seed(rows * size)
    norm = RMSNorm("w", size, 1e-5, dtype, CPU, TorchBackend(CPU, dtype))
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size, generator=generator))
    wide = (torch.randn(rows, size + 8, generator=generator) * 3).to(dtype)
    x = wide[:, 4:4 + size]
    expected = norm(x)
    got = KERNEL.rms_norm(x, norm.weight, 1e-5)
    assert got.dtype == dtype and got.shape == expected.shape
    # One step of each rounding: of the normalised value (then scaled by the weight) and of the product.
    normalised = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    step = torch.finfo(dtype).eps * (normalised.abs() * norm.weight.float().abs() + expected.float().abs())
    assert bool(((got.float() - expected.float()).abs() <= step).all())
    assert (got == expected).float().mean() > 0.99
