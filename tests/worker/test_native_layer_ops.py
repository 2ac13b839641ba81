"""The compiled layer steps (`worker_service/native/kernels.py`: `add_rms_norm`, `silu_mul`, `rope_store`) equal the
PyTorch ops they replace.

In half precision they round where the reference code rounds, so they are compared for equality
(RMSNorm: within one step of the dtype, its sum of squares is taken in another order); in float32
within float32's last bits. RoPE + K/V write: q and k rotated in place as `apply_rotary` rotates
them, keys and values stored at exactly the named slots of the head-major pool and nowhere else,
the values in `qkv` left as they were; for head sizes 16/64/128, SmolLM2's heads as one rank and as
each TP=2 rank holds them, and 1 and 2 threads (shapes on both sides of the kernels' thresholds for
using a thread team). The small-batch linear kernel (bfloat16, AVX512-BF16) against float32's
product of the same values, within one bfloat16 rounding, and linear layers using it for
decode-sized products only (up to `GEMV_MAX_ROWS` rows).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_service import native
from worker_service.backends.native_backend import NativeBackend
from worker_service.backends.torch_backend import TorchBackend
from worker_service.layers.norm import RMSNorm
from worker_service.layers.rotary import apply_rotary
from worker_service.layers.sharding import shard_heads

KERNEL = native.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"the kernels do not build here: {native.failure()}")
CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close_or_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)
    else:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,size", [(1, 576), (32, 576), (300, 576), (7, 40)])
def test_add_rms_norm_equals_an_add_then_the_norm(rows, size, dtype, threads) -> None:
    generator = torch.Generator().manual_seed(rows + size)
    norm = RMSNorm("w", size, 1e-5, dtype, CPU, TorchBackend(CPU, dtype))
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size, generator=generator))
    residual = (torch.randn(rows, size, generator=generator) * 3).to(dtype)
    delta = torch.randn(rows, size, generator=generator).to(dtype)
    expected_sum = residual + delta
    expected = norm(expected_sum)  # PyTorch's ops (the layer is on the PyTorch backend)
    updated = residual.clone()
    got = KERNEL.add_rms_norm(updated, delta, norm.weight, 1e-5)
    assert torch.equal(updated, expected_sum)  # the residual stream, rounded as a plain add
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    else:
        step = torch.finfo(dtype).eps * 2 * expected.float().abs().clamp(min=1e-3)
        assert bool(((got.float() - expected.float()).abs() <= step).all())
        assert (got == expected).float().mean() > 0.99
    # The layer's `add` gives the same on the compiled kernels' backend and on PyTorch's.
    plain_backend, norm.backend = norm.backend, NativeBackend(KERNEL, dtype)
    fused, fused_sum = norm.add(delta, residual.clone())
    norm.backend = plain_backend
    plain, plain_sum = norm.add(delta, residual.clone())
    assert torch.equal(fused_sum, plain_sum)
    assert torch.equal(fused, got) and torch.equal(plain, expected)


def test_add_rms_norm_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="contiguous tensors of one shape"):
        KERNEL.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,features", [(1, 1536), (32, 1536), (200, 1536), (3, 20)])
def test_silu_mul_equals_silu_of_gate_times_up(rows, features, dtype, threads) -> None:
    generator = torch.Generator().manual_seed(rows * features)
    gate_up = (torch.randn(rows, 2 * features, generator=generator) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = KERNEL.silu_mul(gate_up)
    assert got.shape == (rows, features) and got.dtype == dtype
    close_or_equal(got, expected)
    assert torch.equal(KERNEL.silu_mul(gate_up.t().contiguous().t()), got)  # non-contiguous input


def rope_tables(head_dim: int, positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables laid out as `RotaryEmbedding` lays them (half-split, sin signed)."""
    angles = torch.outer(torch.arange(positions, dtype=torch.float32),
                         1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.cat([angles, angles], dim=-1)
    signs = torch.cat([-torch.ones(head_dim // 2), torch.ones(head_dim // 2)])
    return angles.cos().to(dtype), (angles.sin() * signs).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("heads", [(9, 3, 1, 0), (9, 3, 2, 0), (9, 3, 2, 1)], ids=["tp1", "tp2-rank0", "tp2-rank1"])
@pytest.mark.parametrize("tokens", [1, 33, 100])
def test_rope_store_rotates_in_place_and_writes_only_the_named_slots(tokens, heads, head_dim, dtype,
                                                                    threads) -> None:
    total_q, total_kv, world_size, rank = heads
    shard = shard_heads(total_q, total_kv, world_size, rank)
    num_q, num_kv = shard.num_q_heads, shard.num_kv_heads
    generator = torch.Generator().manual_seed(tokens * head_dim + rank)
    cos, sin = rope_tables(head_dim, 4096, dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    num_slots = 512
    slots = torch.randperm(num_slots, generator=generator)[:tokens]
    qkv = torch.randn(tokens, num_q + 2 * num_kv, head_dim, generator=generator).to(dtype)
    pool = torch.randn(2, num_kv, num_slots, head_dim, generator=generator).to(dtype)
    k_slots, v_slots = pool[0], pool[1]

    rotated = apply_rotary(qkv[:, : num_q + num_kv], cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    expected_pool = pool.clone()
    expected_pool[0][:, slots] = rotated[:, num_q:].transpose(0, 1)
    expected_pool[1][:, slots] = qkv[:, num_q + num_kv:].transpose(0, 1)
    values = qkv[:, num_q + num_kv:].clone()

    KERNEL.rope_store(qkv, num_q, positions, cos, sin, k_slots, v_slots, slots)
    close_or_equal(qkv[:, : num_q + num_kv], rotated)
    assert torch.equal(qkv[:, num_q + num_kv:], values)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(pool[:, :, untouched], expected_pool[:, :, untouched])
    close_or_equal(pool[0][:, slots], expected_pool[0][:, slots])
    assert torch.equal(pool[1][:, slots], expected_pool[1][:, slots])


def test_rope_store_refuses_what_it_cannot_read() -> None:
    cos, sin = rope_tables(16, 8, torch.float32)
    qkv = torch.zeros(2, 5, 16)
    pool = torch.zeros(2, 1, 8, 16)
    positions, slots = torch.tensor([0, 1]), torch.tensor([2, 3])
    with pytest.raises(ValueError, match="does not hold"):
        KERNEL.rope_store(qkv, 4, positions, cos, sin, pool[0], pool[1], slots)  # 4 + 2 x 1 != 5
    with pytest.raises(ValueError, match="int64"):
        KERNEL.rope_store(qkv, 3, positions.int(), cos, sin, pool[0], pool[1], slots)
    with pytest.raises(ValueError, match="contiguous"):
        KERNEL.rope_store(qkv, 3, positions, cos[:, ::2], sin, pool[0], pool[1], slots)


def gemv_dtypes() -> list:
    """bfloat16 where this CPU has AVX512-BF16 (skipped otherwise), float32 and float16 wherever the
    kernel builds."""
    return [pytest.param(dtype, id=name, marks=pytest.mark.skipif(
                KERNEL is None or dtype not in KERNEL.gemv_dtypes, reason=f"no small-batch linear kernel for {dtype} here"))
            for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32"), (torch.float16, "fp16"))]


@pytest.mark.parametrize("dtype", gemv_dtypes())
@pytest.mark.parametrize("n,k", [(832, 576), (50, 64), (130, 18), (64, 2), (70, 7)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 33, 64, 65, 128])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_gemv_equals_a_linear_layer_within_one_rounding(dtype, n, k, rows, bias, threads) -> None:
    """x W^T (+ b) against the exact product of the same values (float64): within float32's error
    of sums of K products (float32 sums in another order), plus one rounding of the result to
    bfloat16 or float16; rows read from a wider tensor. Odd K except in bfloat16 (which refuses it)."""
    if dtype == torch.bfloat16 and k % 2:
        pytest.skip("bfloat16 needs an even K (see the refusal test)")
    generator = torch.Generator().manual_seed(n * k + rows)
    weight = (torch.randn(n, k, generator=generator) * 0.1).to(dtype)
    b = torch.randn(n, generator=generator).to(dtype) if bias else None
    wide = torch.randn(rows, k + 6, generator=generator).to(dtype)
    x = wide[:, 3:3 + k]
    packed = KERNEL.pack_gemv(weight)
    got = KERNEL.gemv(x, packed, b)
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert got.shape == (rows, n) and got.dtype == dtype
    # Each of the K + 1 float32 additions errs by at most float32's eps of the running magnitude;
    # bfloat16 and float16 results are then rounded once more, to their own eps of the value, or
    # below their smallest normal value to the fixed spacing of their subnormals (float16: 2^-24,
    # which a 128-row product of K = 2 reaches).
    magnitude = F.linear(x.double().abs(), weight.double().abs(), None if b is None else b.double().abs())
    step = (k + 2) * torch.finfo(torch.float32).eps * magnitude + 1e-30
    if dtype != torch.float32:
        info = torch.finfo(dtype)
        step = step + info.eps * exact.abs() + info.smallest_normal * info.eps
    assert bool(((got.double() - exact).abs() <= step).all())


def test_gemv_packing_is_refused_where_the_kernel_does_not_run() -> None:
    assert KERNEL.pack_gemv(torch.zeros(8, 8, dtype=torch.float64)) is None  # no such kernel
    assert KERNEL.pack_gemv(torch.zeros(8, 7, dtype=torch.bfloat16)) is None  # odd K: pairs of x
    assert KERNEL.pack_gemv(torch.zeros(8, 7)) is not None  # float32 and float16 take any K
    assert KERNEL.pack_gemv(torch.zeros(8, 7, dtype=torch.float16)) is not None
    with pytest.raises(TypeError, match="float32"):
        KERNEL.gemv(torch.zeros(1, 7, dtype=torch.bfloat16), KERNEL.pack_gemv(torch.zeros(8, 7)))


@pytest.mark.parametrize("dtype", gemv_dtypes())
def test_linear_layers_use_the_small_batch_kernel_for_decode_sized_products_only(dtype, monkeypatch) -> None:
    from worker_service.backends.linear_native import GEMV_MAX_ROWS
    from worker_service.backends.linear_torch import widens_to_float32
    from worker_service.layers.linear import Linear

    generator = torch.Generator().manual_seed(7)
    weight = (torch.randn(96, 64, generator=generator) * 0.1).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    plain, fast = Linear(weight.clone(), bias.clone()), Linear(weight.clone(), bias.clone())
    plain.pack()
    fast.pack(NativeBackend(KERNEL, dtype))
    assert getattr(fast.packed, "gemv", None) is not None and getattr(plain.packed, "gemv", None) is None
    calls: list[int] = []
    original = native.NativeKernels.gemv

    def counted(self, x, *args):
        calls.append(x.shape[0])
        return original(self, x, *args)

    monkeypatch.setattr(native.NativeKernels, "gemv", counted)
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 3 * GEMV_MAX_ROWS):
        x = torch.randn(rows, 64, generator=generator).to(dtype)
        got, expected = fast(x), plain(x)
        assert got.dtype == expected.dtype == dtype  # float16 widened for oneDNN: rounded back
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=1e-2)
    assert calls == [1, GEMV_MAX_ROWS]  # more rows go to oneDNN's kernel
    assert plain.packed.widened == fast.packed.larger.widened == widens_to_float32(weight)
