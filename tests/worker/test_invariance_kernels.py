"""Batch and cache invariance of the deterministic backend's kernels (`--deterministic`), bit for bit.

- A linear layer's row (through `InvariantTorchBackend.pack`, float32 and bfloat16, the LM head
  with float32 output too) equals the same row multiplied alone, for every row count 1 .. 300.
- RMSNorm (alone and with the residual add) row by row, for 1 .. 64 rows and 300.
- Attention: the newest token of a sequence whose prefix is shared by a group of 1 .. 64 decode
  rows (as the cascade would group them) gets the same bits as that token decoded alone, as the
  last token of a fresh prefill of the whole sequence, and as the last token of a prefill chunk
  over a cached prefix; every prefill token equals its decode too.
Shapes: one KV head of SmolLM2's (3 query heads over it, head_dim 64), with a prefix spanning a
whole key chunk and a partial page.
"""

from __future__ import annotations

import pytest
import torch

from worker_service.backends.base import PrefillChunk, StepBatch
from worker_service.backends.invariant_backend import InvariantTorchBackend
from worker_service.backends.selection import select_backend

CPU = torch.device("cpu")
MAX_ROWS = 300
# (dtype, out_features, in_features, float32_out): SmolLM2's input widths (hidden 576, MLP 1536)
# with few outputs (the reduction over in_features is what varies; out_features only multiplies
# the cost), a product with a bias and one with float32 output as the LM head's.
LINEAR_CASES = [(torch.float32, 64, 576, False), (torch.float32, 32, 1536, True), (torch.bfloat16, 32, 576, False),
                (torch.bfloat16, 32, 576, True)]


@pytest.mark.parametrize("dtype, out_features, in_features, float32_out", LINEAR_CASES,
                         ids=[f"{str(c[0])[6:]}-{c[1]}x{c[2]}{'-f32out' if c[3] else ''}" for c in LINEAR_CASES])
def test_linear_row_is_the_same_for_every_row_count(dtype, out_features, in_features, float32_out):
    backend = InvariantTorchBackend(CPU, dtype)
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5).to(dtype)
    bias = None if float32_out else torch.randn(out_features, generator=generator).to(dtype)
    linear = backend.pack(weight, bias, float32_out=float32_out)
    rows = torch.randn(MAX_ROWS, in_features, generator=generator).to(dtype)
    alone = torch.cat([linear(rows[i:i + 1]) for i in range(MAX_ROWS)])
    for num_rows in range(1, MAX_ROWS + 1):
        assert torch.equal(linear(rows[:num_rows]), alone[:num_rows]), num_rows


NORM_ROW_COUNTS = 65  # 1 .. 64 rows, then MAX_ROWS: row-wise kernels have no tiles to cross


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rms_norm_and_add_rms_norm_rows_do_not_depend_on_the_row_count(dtype):
    backend = InvariantTorchBackend(CPU, dtype)
    generator = torch.Generator().manual_seed(2)
    rows = torch.randn(MAX_ROWS, 576, generator=generator).to(dtype)
    residual = torch.randn(MAX_ROWS, 576, generator=generator).to(dtype)
    weight = torch.randn(576, generator=generator).to(dtype)
    alone = torch.cat([backend.rms_norm(rows[i:i + 1], weight, 1e-5) for i in range(MAX_ROWS)])
    alone_added = torch.cat([backend.add_rms_norm(rows[i:i + 1], residual[i:i + 1].clone(), weight, 1e-5)[0]
                             for i in range(MAX_ROWS)])
    for num_rows in [*range(1, NORM_ROW_COUNTS), MAX_ROWS]:
        assert torch.equal(backend.rms_norm(rows[:num_rows], weight, 1e-5), alone[:num_rows]), num_rows
        added, _ = backend.add_rms_norm(rows[:num_rows], residual[:num_rows].clone(), weight, 1e-5)
        assert torch.equal(added, alone_added[:num_rows]), num_rows


NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 3, 1, 64
PAGE_SIZE = 16
PREFIX_LEN = 70  # shared by every row: a full key chunk of 64, then a partial page
MAX_ROWS_IN_GROUP = 64


class Sequences:
    """Per sequence s and position p: fixed random q, k, v, and the page its position lives in.
    Sequence s shares the prefix's pages; its own tail pages follow (no two sequences share a tail)."""

    def __init__(self, num_sequences: int, dtype: torch.dtype) -> None:
        generator = torch.Generator().manual_seed(1)
        self.lengths = [PREFIX_LEN + 1 + (s * 7) % 13 for s in range(num_sequences)]
        longest = max(self.lengths)
        self.q = torch.randn(num_sequences, longest, NUM_Q_HEADS, HEAD_DIM, generator=generator).to(dtype)
        self.k = torch.randn(num_sequences, longest, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        self.v = torch.randn(num_sequences, longest, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        shared_pages = PREFIX_LEN // PAGE_SIZE  # whole pages of the prefix; the rest is each sequence's own
        self.k[:, :shared_pages * PAGE_SIZE] = self.k[0, :shared_pages * PAGE_SIZE]
        self.v[:, :shared_pages * PAGE_SIZE] = self.v[0, :shared_pages * PAGE_SIZE]
        pages_each = -(-longest // PAGE_SIZE) - shared_pages
        # Pages handed out in a scrambled order: physical ids must not matter.
        order = torch.randperm(shared_pages + num_sequences * pages_each, generator=generator).tolist()
        self.tables = [order[:shared_pages] + order[shared_pages + s * pages_each: shared_pages + (s + 1) * pages_each]
                       for s in range(num_sequences)]
        num_slots = len(order) * PAGE_SIZE
        self.k_slots = torch.zeros(NUM_KV_HEADS, num_slots, HEAD_DIM, dtype=dtype)
        self.v_slots = torch.zeros_like(self.k_slots)

    def slots(self, s: int, positions: range) -> torch.Tensor:
        return torch.tensor([self.tables[s][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in positions])

    def write(self, s: int, positions: range) -> None:
        """K/V of positions already cached (written by an earlier step)."""
        slots = self.slots(s, positions)
        self.k_slots[:, slots] = self.k[s, positions.start:positions.stop].transpose(0, 1)
        self.v_slots[:, slots] = self.v[s, positions.start:positions.stop].transpose(0, 1)


def run_step(backend, seqs: Sequences, decode_rows: list[int], prefill: tuple[int, int, int] | None = None):
    """One step: decode the newest token of each of `decode_rows`, then (sequence, start, stop) as
    a prefill chunk. Returns the attention output `[T, Hq, D]` in the flat layout."""
    tokens = [(s, seqs.lengths[s] - 1) for s in decode_rows]
    prefills = []
    if prefill is not None:
        s, start, stop = prefill
        prefills.append(PrefillChunk(len(tokens), start, stop - start, seqs.tables[s],
                                     torch.tensor(seqs.tables[s])))
        tokens += [(s, p) for s in [s] for p in range(start, stop)]
    slots = torch.cat([seqs.slots(s, range(p, p + 1)) for s, p in tokens])
    batch = StepBatch(PAGE_SIZE, torch.tensor([p for _, p in tokens]), slots,
                      [seqs.tables[s] for s in decode_rows], [seqs.lengths[s] for s in decode_rows], prefills)
    step = backend.plan(batch, None)
    q = torch.stack([seqs.q[s, p] for s, p in tokens])
    k = torch.stack([seqs.k[s, p] for s, p in tokens])
    v = torch.stack([seqs.v[s, p] for s, p in tokens])
    return step.attention.attend(q, k, v, seqs.k_slots, seqs.v_slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_attention_is_the_same_alone_in_groups_cached_and_prefilled(dtype):
    backend = InvariantTorchBackend(CPU, dtype)
    seqs = Sequences(MAX_ROWS_IN_GROUP, dtype)
    for s in range(MAX_ROWS_IN_GROUP):
        seqs.write(s, range(seqs.lengths[s] - 1))
    alone = [run_step(backend, seqs, [s])[0] for s in range(MAX_ROWS_IN_GROUP)]
    for group_size in range(1, MAX_ROWS_IN_GROUP + 1):
        together = run_step(backend, seqs, list(range(group_size)))
        for s in range(group_size):
            assert torch.equal(together[s], alone[s]), (group_size, s)
    length = seqs.lengths[0]
    fresh = run_step(backend, seqs, [], (0, 0, length))  # the whole sequence as one prefill
    assert torch.equal(fresh[-1], alone[0])
    cached = run_step(backend, seqs, [], (0, PREFIX_LEN - 5, length))  # a chunk over a cached prefix
    assert torch.equal(cached[-1], alone[0])
    # Every prefilled token equals that token decoded alone (what a retraction recomputes).
    for position in (0, 1, 15, 63, 64, PREFIX_LEN - 1):
        seqs.lengths[0] = position + 1
        assert torch.equal(fresh[position], run_step(backend, seqs, [0])[0]), position
    # Decoded among others while another sequence prefills in the same step.
    seqs.lengths[0] = length
    mixed = run_step(backend, seqs, [0, 5], (9, 0, seqs.lengths[9]))
    assert torch.equal(mixed[0], alone[0]) and torch.equal(mixed[-1], alone[9])


def test_deterministic_selection_takes_the_invariant_backend_or_refuses_saying_why():
    chosen = select_backend("auto", "cpu", torch.float32, HEAD_DIM, deterministic=True)
    assert isinstance(chosen.backend, InvariantTorchBackend) and "deterministic" in chosen.reason
    refusals = [(dict(choice="auto", device="cuda"), "CPU only"), (dict(choice="native", device="cpu"), "native"),
                (dict(choice="triton", device="cpu"), "triton"),
                (dict(choice="auto", device="cpu", quantization="int8"), "--quantization int8")]
    for settings, reason in refusals:
        with pytest.raises(RuntimeError, match=f"--deterministic: .*{reason}"):
            select_backend(settings["choice"], settings["device"], torch.float32, HEAD_DIM,
                           quantization=settings.get("quantization", "none"), deterministic=True)
