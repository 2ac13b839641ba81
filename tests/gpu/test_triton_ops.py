"""The Triton row-wise ops (RMSNorm, residual add + RMSNorm, SwiGLU) against the PyTorch backend's ops:
the same roundings, so equal up to the order of the norm's float32 additions. Runs on CUDA, or
in Triton's CPU interpreter with TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton_ops = pytest.importorskip("worker_service.backends.triton_row_ops")
from worker_service.backends.torch_backend import TorchBackend  # noqa: E402
from worker_service.backends.triton_backend import TritonBackend  # noqa: E402
from worker_service.layers.norm import RMSNorm  # noqa: E402
from worker_service.layers.rotary import apply_rotary  # noqa: E402
from worker_service.triton_support import available  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not available(DEVICE), reason="no Triton for this device")
EPS = 1e-5
# One rounding step apart at most where the mean's additions are ordered differently.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2 ** -7, atol=1e-3),
             torch.float16: dict(rtol=2 ** -10, atol=1e-4)}
INTERPRETER = DEVICE.type == "cpu" and available(DEVICE)
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    INTERPRETER, reason="Triton's CPU interpreter truncates float32 to bfloat16 (the GPU rounds to nearest)"))]


def norm_pair(size: int, dtype: torch.dtype, seed: int) -> tuple[RMSNorm, RMSNorm]:
    """The same RMSNorm twice: on the PyTorch backend and on the Triton backend."""
    plain = RMSNorm("w", size, EPS, dtype, DEVICE, TorchBackend(DEVICE, dtype))
    fused = RMSNorm("w", size, EPS, dtype, DEVICE, TritonBackend(DEVICE, dtype))
    weight = (torch.randn(size, generator=torch.Generator().manual_seed(seed)) * 0.3 + 1).to(dtype)
    with torch.no_grad():
        plain.weight.copy_(weight)
        fused.weight.copy_(weight)
    return plain, fused


def rows(num_rows: int, size: int, dtype: torch.dtype, seed: int, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(num_rows, size, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_rows", "size"), [(1, 576), (7, 64), (33, 2048), (3, 100)])
def test_rms_norm_equals_the_torch_path(dtype, num_rows, size) -> None:
    plain, fused = norm_pair(size, dtype, num_rows)
    x = rows(num_rows, size, dtype, size)
    with torch.no_grad():
        torch.testing.assert_close(fused(x).float(), plain(x).float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_leaves_the_sum_in_the_residual(dtype) -> None:
    plain, fused = norm_pair(576, dtype, 1)
    x, residual = rows(9, 576, dtype, 2), rows(9, 576, dtype, 3, scale=20.0)
    with torch.no_grad():
        expected_norm, expected_sum = plain.add(x, residual.clone())
        own = residual.clone()
        normed, summed = fused.add(x, own)
    assert summed.data_ptr() == own.data_ptr()
    assert torch.equal(summed, expected_sum)  # one rounding of the same float32 sum
    torch.testing.assert_close(normed.float(), expected_norm.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_rows", "size"), [(1, 1536), (5, 100), (2, 3000)])
def test_silu_mul_equals_the_torch_path(dtype, num_rows, size) -> None:
    gate_up = rows(num_rows, 2 * size, dtype, size, scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = triton_ops.TritonRowOps().silu_mul(gate_up)
    assert got.shape == (num_rows, size)
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "num_q_heads", "num_kv_heads", "head_dim"), [(1, 9, 3, 64), (37, 4, 2, 128)])
def test_rope_store_equals_rotating_then_storing(dtype, num_tokens, num_q_heads, num_kv_heads, head_dim) -> None:
    """q and k rotated as `apply_rotary` does, within one rounding (the GPU's compiler fuses the
    products and their sum into one multiply-add where PyTorch rounds each); the pool's k is the
    rotated k bit for bit, its v the projection's, every other slot untouched."""
    generator = torch.Generator().manual_seed(num_tokens)
    num_heads, max_positions, num_slots = num_q_heads + 2 * num_kv_heads, 300, 512
    qkv = (torch.randn(num_tokens, num_heads, head_dim, generator=generator) * 3).to(dtype).to(DEVICE)
    cos = torch.randn(max_positions, head_dim, generator=generator).to(dtype).to(DEVICE)
    sin = torch.randn(max_positions, head_dim, generator=generator).to(dtype).to(DEVICE)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=generator).to(DEVICE)
    write_slots = torch.randperm(num_slots, generator=generator)[:num_tokens].to(DEVICE)
    pool = torch.randn(2, num_kv_heads, num_slots, head_dim, generator=generator).to(dtype).to(DEVICE)
    original_qkv, original_pool = qkv.clone(), pool.clone()
    rotated = apply_rotary(qkv[:, : num_q_heads + num_kv_heads], cos[positions].unsqueeze(1),
                           sin[positions].unsqueeze(1))

    triton_ops.TritonRowOps().rope_store(qkv, num_q_heads, positions, cos, sin, pool[0], pool[1], write_slots)
    # One rounding of a product or the sum apart: bounded by the products' size, not the result's.
    rows = original_qkv[:, : num_q_heads + num_kv_heads].float()
    products = (rows * cos[positions].unsqueeze(1).float()).abs() + (rows.roll(head_dim // 2, dims=-1)
                                                                     * sin[positions].unsqueeze(1).float()).abs()
    error = (qkv[:, : num_q_heads + num_kv_heads].float() - rotated.float()).abs()
    assert (error <= 2 * torch.finfo(dtype).eps * products).all()
    assert torch.equal(qkv[:, num_q_heads + num_kv_heads:], original_qkv[:, num_q_heads + num_kv_heads:])
    expected_pool = original_pool.clone()
    expected_pool[0].index_copy_(1, write_slots, qkv[:, num_q_heads:num_q_heads + num_kv_heads].transpose(0, 1))
    expected_pool[1].index_copy_(1, write_slots, original_qkv[:, num_q_heads + num_kv_heads:].transpose(0, 1))
    assert torch.equal(pool, expected_pool)
