"""The PyTorch decode attention (cascade over shared prefixes) on CUDA: the fallback where the
Triton kernel does not apply, and the reference it is tested against."""

from __future__ import annotations

import pytest
import torch

from worker.test_cascade_attention import HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, build_batch, reference_attention
from worker_service.attention.cascade import decode_attention
from worker_service.attention.decode_plan import plan_decode

DEVICE = torch.device("cuda")
FP32_ATOL = 1e-5
BF16_ATOL = 2e-2


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_on_cuda_equals_plain_attention(seed: int, page_size: int, dtype: torch.dtype) -> None:
    k, v, tables, lens, _ = build_batch(seed, page_size, NUM_KV_HEADS, dtype)
    q = torch.randn(len(tables), NUM_Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)
    expected = reference_attention(q, k, v, tables, lens, page_size)
    plan = plan_decode(tables, lens, page_size, DEVICE)
    got = decode_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), plan, page_size)
    torch.testing.assert_close(got.float().cpu(), expected, rtol=0,
                               atol=FP32_ATOL if dtype == torch.float32 else BF16_ATOL)

