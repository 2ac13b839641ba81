"""Paged decode attention in Triton: one query token per row reads K/V through its page table.

Algorithm (split-K, "flash decoding"). The first kernel runs one program per (row, KV head,
split). It loads the queries of that KV head's GQA group as one `[BLOCK_G, D]` tile (rows past
the group are masked), walks its split's keys in blocks of `BLOCK_N`, finds each key's slot from
the page table (`block_tables[row, t // page_size] * page_size + t % page_size`), and keeps an
online softmax: scores in float32 from `tl.dot`, a running max and sum, and a float32
accumulator of the weighted V. It ends with the split's partial output and its log-sum-exp.
With one split that partial is the answer and is written straight to `out`; otherwise the
partials go to float32 scratch and a second kernel merges them exactly by their log-sum-exps
(the merge of `kernels.merge_by_lse`, over any number of parts).

Invariants:
- Capturable in a CUDA graph: grids, splits and scratch depend only on shapes (B, Hq, Hk, D,
  max_pages) and page_size; a row's length is read on the device, and each program derives its
  key range from it. Nothing synchronises with the host.
- Only positions `0 .. context_lens[row]-1` are read; page-table entries past them never are.
- A split with no keys (short rows leave the last splits empty) reports lse = -inf and merges
  with weight 0; every row has at least one key (context_lens >= 1), so the merge never divides
  by zero.
- Log-sum-exps are kept in base 2 (scores are pre-scaled by log2(e), so `exp2` is the exponent);
  the merge is the same in any base.
- Precision: Q·K of half-precision inputs multiplies exactly and sums in float32; P·V feeds the
  float32 weights with tf32 (10 mantissa bits, where casting them to bfloat16 would keep 7).
  Float32 models use full IEEE float32 in both products.
"""

from __future__ import annotations

import math

import torch

from worker_service.triton_support import interpreting, tl, triton

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Keys per inner-loop step: several pages at the usual page sizes, one tensor-core tile wide.
BLOCK_N = 64
# Smallest query tile `tl.dot` takes; groups are padded up to it.
MIN_BLOCK_G = 16
# Split until about this many programs run per SM (first kernel), capped at MAX_SPLITS.
PROGRAMS_PER_SM = 2
MAX_SPLITS = 16
# SM count assumed where the device reports none (the CPU interpreter).
FALLBACK_NUM_SMS = 132


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether `paged_decode` handles this head size and model dtype."""
    return head_dim in SUPPORTED_HEAD_DIMS and dtype in SUPPORTED_DTYPES


if triton is not None:

    @triton.jit
    def _split_kernel(
        q, k_slots, v_slots, block_tables, context_lens, out, part_out, part_lse,
        stride_qb, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_bt,
        stride_ob, stride_oh, qk_scale, group_size, num_splits,
        PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr,
        UPCAST_QK: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        context_len = tl.load(context_lens + row)
        # Splits cover whole key blocks; trailing splits of a short row are empty.
        split_len = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
        key_start = split * split_len
        key_stop = tl.minimum(key_start + split_len, context_len)

        group_ids = tl.arange(0, BLOCK_G)
        head_ids = kv_head * group_size + group_ids
        group_mask = group_ids < group_size
        dims = tl.arange(0, HEAD_DIM)
        q_ptrs = q + row * stride_qb + head_ids[:, None] * stride_qh + dims[None, :]
        queries = tl.load(q_ptrs, mask=group_mask[:, None], other=0.0)
        if UPCAST_QK:
            queries = queries.to(tl.float32)

        running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        k_head = k_slots + kv_head.to(tl.int64) * stride_kh
        v_head = v_slots + kv_head.to(tl.int64) * stride_vh
        for block_start in range(key_start, key_stop, BLOCK_N):
            positions = block_start + tl.arange(0, BLOCK_N)
            key_mask = positions < key_stop
            page_ids = tl.load(block_tables + row * stride_bt + positions // PAGE_SIZE, mask=key_mask, other=0)
            slot_ids = page_ids.to(tl.int64) * PAGE_SIZE + positions % PAGE_SIZE
            keys = tl.load(k_head + slot_ids[:, None] * stride_ks + dims[None, :], mask=key_mask[:, None], other=0.0)
            if UPCAST_QK:  # exact either way: half-precision products fit in float32
                keys = keys.to(tl.float32)
            scores = tl.dot(queries, tl.trans(keys), input_precision=DOT_PRECISION) * qk_scale
            scores = tl.where(key_mask[None, :], scores, float("-inf"))
            # Every block holds at least one key, so the new max is finite.
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            rescale = tl.math.exp2(running_max - new_max)
            weights = tl.math.exp2(scores - new_max[:, None])
            running_sum = running_sum * rescale + tl.sum(weights, 1)
            values = tl.load(v_head + slot_ids[:, None] * stride_vs + dims[None, :], mask=key_mask[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(weights, values.to(tl.float32), input_precision=DOT_PRECISION)
            running_max = new_max

        has_keys = running_sum > 0.0
        safe_sum = tl.where(has_keys, running_sum, 1.0)  # an empty split has acc == 0
        partial = acc / safe_sum[:, None]
        if DIRECT:
            out_ptrs = out + row * stride_ob + head_ids[:, None] * stride_oh + dims[None, :]
            tl.store(out_ptrs, partial.to(out.dtype.element_ty), mask=group_mask[:, None])
        else:
            lse = tl.where(has_keys, running_max + tl.math.log2(safe_sum), float("-inf"))
            # Scratch is [B, Hq, num_splits(, D)]; Hq = Hk * group_size and Hk = num_programs(1).
            part_ids = (row * tl.num_programs(1) * group_size + head_ids) * num_splits + split
            tl.store(part_lse + part_ids, lse, mask=group_mask)
            part_ptrs = part_out + part_ids[:, None] * HEAD_DIM + dims[None, :]
            tl.store(part_ptrs, partial, mask=group_mask[:, None])

    @triton.jit
    def _merge_kernel(
        part_out, part_lse, out, stride_ob, stride_oh, num_q_heads, num_splits,
        HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        row_head = tl.program_id(0)  # row * num_q_heads + head
        row = row_head // num_q_heads
        head = row_head % num_q_heads
        split_ids = tl.arange(0, BLOCK_S)
        split_mask = split_ids < num_splits
        dims = tl.arange(0, HEAD_DIM)
        lse = tl.load(part_lse + row_head * num_splits + split_ids, mask=split_mask, other=float("-inf"))
        # At least one split of every row has keys, so `top` is finite and empty splits weigh 0.
        weights = tl.math.exp2(lse - tl.max(lse, 0))
        part_ptrs = part_out + (row_head * num_splits + split_ids)[:, None] * HEAD_DIM + dims[None, :]
        parts = tl.load(part_ptrs, mask=split_mask[:, None], other=0.0)
        merged = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
        tl.store(out + row * stride_ob + head * stride_oh + dims, merged.to(out.dtype.element_ty))


def default_num_splits(batch_size: int, num_kv_heads: int, max_pages: int, page_size: int,
                       device: torch.device) -> int:
    """Splits per row from static shapes: enough programs to fill the SMs, no split shorter than a key block."""
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        num_sms = FALLBACK_NUM_SMS
    wanted = math.ceil(PROGRAMS_PER_SM * num_sms / (batch_size * num_kv_heads))
    most = math.ceil(max_pages * page_size / BLOCK_N)
    return max(1, min(wanted, most, MAX_SPLITS))


def paged_decode(
    q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, page_size: int, out: torch.Tensor | None = None, *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention of one token per row over its paged context: q `[B, Hq, D]` -> `[B, Hq, D]`.

    `k_slots` / `v_slots` are one layer's head-major pool `[Hk, num_slots, D]`; row b attends to
    its positions `0 .. context_lens[b]-1` (int32 `[B]`, each >= 1) found through `block_tables`
    (int32 `[B, max_pages]`). Query head h reads KV head `h // (Hq // Hk)`; the softmax scale is
    D ** -0.5. `q` may be a strided view (its last dim must be unit-stride). The result is in
    q's dtype, written into `out` when given. `num_splits` overrides `default_num_splits`.
    Graph-capturable: nothing here depends on the values of `context_lens` or `block_tables`.
    """
    batch_size, num_q_heads, head_dim = q.shape
    num_kv_heads = k_slots.shape[0]
    if not supports(head_dim, q.dtype):
        raise ValueError(f"triton paged_decode supports head_dim in {SUPPORTED_HEAD_DIMS} and dtypes "
                         f"{SUPPORTED_DTYPES}, got head_dim={head_dim}, dtype={q.dtype}")
    if num_q_heads % num_kv_heads or k_slots.shape[2] != head_dim or v_slots.shape != k_slots.shape:
        raise ValueError(f"q {tuple(q.shape)} does not match the pool {tuple(k_slots.shape)} / {tuple(v_slots.shape)}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    if q.stride(2) != 1 or k_slots.stride(2) != 1 or v_slots.stride(2) != 1:
        raise ValueError("q, k_slots and v_slots need a unit-stride last dimension")
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a unit-stride last dimension")
    max_pages = block_tables.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(batch_size, num_kv_heads, max_pages, page_size, q.device)
    group_size = num_q_heads // num_kv_heads
    block_g = max(MIN_BLOCK_G, triton.next_power_of_2(group_size))
    direct = num_splits == 1
    if direct:  # unused by the kernel, but it needs valid pointers
        part_out = part_lse = out
    else:
        part_out = torch.empty(batch_size, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch_size, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    # Scores in base 2: exp2(s * log2(e)) == exp(s).
    qk_scale = head_dim ** -0.5 * math.log2(math.e)
    _split_kernel[(batch_size, num_kv_heads, num_splits)](
        q, k_slots, v_slots, block_tables, context_lens, out, part_out, part_lse,
        q.stride(0), q.stride(1), k_slots.stride(0), k_slots.stride(1), v_slots.stride(0), v_slots.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), qk_scale,
        group_size, num_splits,
        PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_G=block_g, BLOCK_N=BLOCK_N, DIRECT=direct,
        # Triton's CPU interpreter multiplies bfloat16 `tl.dot` operands as raw bits
        # (triton-lang/triton#11584), so there Q and K enter the dot as float32.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", UPCAST_QK=interpreting(),
    )
    if not direct:
        _merge_kernel[(batch_size * num_q_heads,)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_q_heads, num_splits,
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return out
