"""The Triton paged decode kernel against a float64 gather-and-softmax reference.

Runs on CUDA; without one, only under Triton's CPU interpreter (TRITON_INTERPRET=1), with
sizes kept small because the interpreter is slow. The CUDA-graph test needs a real GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1"
)
pytest.importorskip("triton")

from worker_service.attention import triton_decode  # noqa: E402
from worker_service.attention.triton_decode import paged_decode  # noqa: E402
from worker_service.triton_support import available  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE_SIZE = 16
# Relative error norm allowed per dtype: bf16/f16 round the output (and the tf32 weights).
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-5}
# Lengths that do and don't end on page boundaries, and one long enough for several key blocks.
CONTEXT_LENS = [1, 15, 16, 17, 100, 1000]
# Extra pages in the pool beyond what the rows use, so unused page ids exist.
SPARE_PAGES = 5


class Case:
    """A random pool, shuffled page tables and queries for one call."""

    def __init__(self, context_lens: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, seed: int, extra_pages: int = 2, num_pages: int | None = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        pages_per_row = [-(-n // PAGE_SIZE) for n in context_lens]
        max_pages = max(pages_per_row) + extra_pages
        num_pages = num_pages or sum(pages_per_row) + SPARE_PAGES
        shuffled_ids = torch.randperm(num_pages, generator=gen)
        # Entries past a row's pages hold arbitrary valid page ids.
        self.block_tables = torch.randint(num_pages, (len(context_lens), max_pages), generator=gen)
        used = 0
        for row, num_row_pages in enumerate(pages_per_row):
            self.block_tables[row, :num_row_pages] = shuffled_ids[used:used + num_row_pages]
            used += num_row_pages
        self.pages_per_row = pages_per_row
        self.num_pages = num_pages
        self.context_lens = torch.tensor(context_lens, dtype=torch.int32)
        num_slots = num_pages * PAGE_SIZE
        self.k_slots = torch.randn(num_kv_heads, num_slots, head_dim, generator=gen).to(dtype)
        self.v_slots = torch.randn(num_kv_heads, num_slots, head_dim, generator=gen).to(dtype)
        # Queries twice unit scale so the softmax is far from uniform.
        self.q = (2 * torch.randn(len(context_lens), num_q_heads, head_dim, generator=gen)).to(dtype)

    def on_device(self) -> dict[str, torch.Tensor]:
        """The kernel's tensor arguments on DEVICE."""
        return {
            "q": self.q.to(DEVICE), "k_slots": self.k_slots.to(DEVICE), "v_slots": self.v_slots.to(DEVICE),
            "block_tables": self.block_tables.to(torch.int32).to(DEVICE),
            "context_lens": self.context_lens.to(DEVICE),
        }

    def reference(self) -> torch.Tensor:
        """Float64 attention of each row over its positions, gathered slot by slot."""
        num_q_heads, head_dim = self.q.shape[1:]
        group_size = num_q_heads // self.k_slots.shape[0]
        rows = []
        for row, context_len in enumerate(self.context_lens.tolist()):
            positions = torch.arange(context_len)
            slot_ids = self.block_tables[row, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
            keys = self.k_slots[:, slot_ids].double().repeat_interleave(group_size, 0)  # [Hq, L, D]
            values = self.v_slots[:, slot_ids].double().repeat_interleave(group_size, 0)
            scores = torch.einsum("hd,hld->hl", self.q[row].double(), keys) * head_dim ** -0.5
            rows.append(torch.einsum("hl,hld->hd", scores.softmax(-1), values))
        return torch.stack(rows)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double().cpu() - expected).norm() / expected.norm()).item()


def nan_out(case: Case) -> torch.Tensor:
    return torch.full(case.q.shape, float("nan"), dtype=case.q.dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (6, 2), (9, 3)])
def test_matches_reference_with_one_and_several_splits(dtype, head_dim, num_q_heads, num_kv_heads):
    case = Case(CONTEXT_LENS, num_q_heads, num_kv_heads, head_dim, dtype, seed=head_dim + num_q_heads)
    expected = case.reference()
    results = []
    for num_splits in (1, 4):
        out = nan_out(case)
        result = paged_decode(**case.on_device(), page_size=PAGE_SIZE, out=out, num_splits=num_splits)
        assert result is out and result.dtype == dtype
        assert not result.isnan().any()
        assert relative_error(result, expected) < TOLERANCE[dtype]
        results.append(result)
    assert relative_error(results[1], results[0].double().cpu()) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_of_37_with_default_splits(dtype):
    gen = torch.Generator().manual_seed(37)
    context_lens = torch.randint(1, 150, (37,), generator=gen).tolist()
    case = Case(context_lens, 9, 3, 64, dtype, seed=1)
    result = paged_decode(**case.on_device(), page_size=PAGE_SIZE)
    assert result.shape == case.q.shape
    assert relative_error(result, case.reference()) < TOLERANCE[dtype]


def test_batch_of_one_long_row_splits_by_default():
    case = Case([1000], 9, 3, 64, torch.float32, seed=2)
    assert triton_decode.default_num_splits(1, 3, case.block_tables.shape[1], PAGE_SIZE, DEVICE) > 1
    result = paged_decode(**case.on_device(), page_size=PAGE_SIZE)
    assert relative_error(result, case.reference()) < TOLERANCE[torch.float32]


def test_more_splits_than_keys_leaves_empty_splits_harmless():
    case = Case([1, 2, 17], 6, 2, 64, torch.float32, seed=3)
    result = paged_decode(**case.on_device(), page_size=PAGE_SIZE, num_splits=triton_decode.MAX_SPLITS)
    assert relative_error(result, case.reference()) < TOLERANCE[torch.float32]


def test_strided_query_view_and_strided_out():
    case = Case([15, 100, 33], 9, 3, 64, torch.float16, seed=4)
    args = case.on_device()
    num_q_heads, num_kv_heads = 9, 3
    qkv = torch.randn(3, num_q_heads + 2 * num_kv_heads, 64, dtype=torch.float16, device=DEVICE)
    qkv[:, :num_q_heads] = args["q"]
    args["q"] = qkv[:, :num_q_heads]
    assert not args["q"].is_contiguous()
    wide_out = torch.full((3, num_q_heads + 2, 64), float("nan"), dtype=torch.float16, device=DEVICE)
    out = wide_out[:, 1:1 + num_q_heads]
    for num_splits in (1, 3):
        result = paged_decode(**args, page_size=PAGE_SIZE, out=out, num_splits=num_splits)
        assert relative_error(result, case.reference()) < TOLERANCE[torch.float16]
    # The columns around the view are untouched.
    assert wide_out[:, 0].isnan().all() and wide_out[:, -1].isnan().all()


@pytest.mark.parametrize("num_splits", [1, 4])
def test_table_entries_past_a_rows_pages_are_ignored(num_splits):
    case = Case([1, 17, 100], 6, 2, 64, torch.bfloat16, seed=5, extra_pages=4)
    args = case.on_device()
    first = paged_decode(**args, page_size=PAGE_SIZE, num_splits=num_splits)
    tables = args["block_tables"]
    for row, num_row_pages in enumerate(case.pages_per_row):
        tables[row, num_row_pages:] = torch.randint(case.num_pages, (tables.shape[1] - num_row_pages,),
                                                    dtype=torch.int32, device=DEVICE)
    second = paged_decode(**args, page_size=PAGE_SIZE, num_splits=num_splits)
    assert torch.equal(first, second)


def test_unsupported_shapes_are_refused():
    assert triton_decode.supports(64, torch.bfloat16) and triton_decode.supports(128, torch.float32)
    assert not triton_decode.supports(80, torch.bfloat16)
    assert not triton_decode.supports(64, torch.float64)
    assert available(DEVICE)
    case = Case([5], 2, 1, 64, torch.float32, seed=6)
    args = case.on_device()
    args["q"] = torch.zeros(1, 2, 80, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode(**args, page_size=PAGE_SIZE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("num_splits", [None, 1])
def test_cuda_graph_replays_with_new_lengths_and_tables(num_splits):
    # Every case has 24 table columns (the longest row, 310, takes 20 pages) and a 64-page pool.
    shape = dict(num_q_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, num_pages=64)
    captured = Case([5, 310, 17, 64], **shape, seed=7, extra_pages=4)
    args = captured.on_device()
    out = torch.empty_like(args["q"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        paged_decode(**args, page_size=PAGE_SIZE, out=out, num_splits=num_splits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode(**args, page_size=PAGE_SIZE, out=out, num_splits=num_splits)
    # New lengths and page tables of the same shapes, over a pool of the same size.
    for seed, context_lens in ((8, [310, 1, 40, 16]), (9, [33, 99, 2, 310])):
        fresh = Case(context_lens, **shape, seed=seed, extra_pages=4)
        for name, tensor in fresh.on_device().items():
            args[name].copy_(tensor)  # same shapes: only values change
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, fresh.reference()) < TOLERANCE[torch.bfloat16]
