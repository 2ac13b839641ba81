"""The row-wise ops of a layer as one Triton kernel each on CUDA: RMSNorm, the residual add with
the RMSNorm after it, SwiGLU's silu(gate) * up, and RoPE with the new K/V's write into the pool.

In PyTorch's ops a half-precision RMSNorm is a chain of six kernels (cast, square, mean, rsqrt,
multiply, cast and weight) and SwiGLU two or three; a small model's decode step on a GPU is bound
by how many kernels it runs, not by their bytes, so these three ops were half of its launches.
Each kernel here is one program per token row and rounds where PyTorch's chain rounds (the sum to
the model dtype before the norm, the normalised row to the dtype before the weight, silu to the
dtype before the product, each RoPE product and their sum), so results differ from the PyTorch
backend's only by the order of the mean's float32 additions and, in RoPE, by one rounding where
the GPU's compiler fuses a product and the sum into one multiply-add (one unit in the last place
on some elements).

`TritonRowOps` is the Triton backend's `RowKernels` (`base.py`, called by `row_kernels.py`).
"""

from __future__ import annotations

import torch

from worker_service.triton_support import tl, triton


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x, residual, weight, out, size, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        columns = tl.arange(0, BLOCK)
        mask = columns < size
        values = tl.load(x + row * size + columns, mask=mask, other=0.0)
        if ADD:  # the residual stream's sum, rounded to the dtype as a plain add is, stored back
            values = (values.to(tl.float32) + tl.load(residual + row * size + columns, mask=mask,
                                                      other=0.0).to(tl.float32)).to(x.dtype.element_ty)
            tl.store(residual + row * size + columns, values, mask=mask)
        values = values.to(tl.float32)
        scale = tl.math.rsqrt(tl.sum(values * values, 0) / size + eps)
        normed = (values * scale).to(x.dtype.element_ty).to(tl.float32)
        scaled = normed * tl.load(weight + columns, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + row * size + columns, scaled.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(gate_up, out, size, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        start = tl.program_id(1) * BLOCK
        columns = start + tl.arange(0, BLOCK)
        mask = columns < size
        gate = tl.load(gate_up + row * 2 * size + columns, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up + row * 2 * size + size + columns, mask=mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out.dtype.element_ty).to(tl.float32)
        tl.store(out + row * size + columns, (silu * up).to(out.dtype.element_ty), mask=mask)


    @triton.jit
    def _rope_store_kernel(qkv, positions, cos, sin, k_slots, v_slots, write_slots, stride_token,
                           stride_slot_head, num_q_heads, num_kv_heads, HEAD_DIM: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)  # q heads, then k heads, then v heads of the merged projection
        dims = tl.arange(0, HEAD_DIM)
        row = qkv + token * stride_token + head * HEAD_DIM
        slot = tl.load(write_slots + token)
        if head < num_q_heads + num_kv_heads:
            position = tl.load(positions + token)
            x = tl.load(row + dims).to(tl.float32)
            swapped = tl.load(row + (dims + HEAD_DIM // 2) % HEAD_DIM).to(tl.float32)  # [x2, x1]
            cos_row = tl.load(cos + position * HEAD_DIM + dims).to(tl.float32)
            sin_row = tl.load(sin + position * HEAD_DIM + dims).to(tl.float32)  # signed: [-sin, sin]
            kind = qkv.dtype.element_ty
            rotated = ((x * cos_row).to(kind).to(tl.float32) + (swapped * sin_row).to(kind).to(tl.float32)).to(kind)
            # Every program reads its whole row before writing: the rotation happens in place.
            tl.debug_barrier()
            tl.store(row + dims, rotated)
            if head >= num_q_heads:
                kv_head = (head - num_q_heads).to(tl.int64)
                tl.store(k_slots + kv_head * stride_slot_head + slot * HEAD_DIM + dims, rotated)
        else:
            kv_head = (head - num_q_heads - num_kv_heads).to(tl.int64)
            tl.store(v_slots + kv_head * stride_slot_head + slot * HEAD_DIM + dims, tl.load(row + dims))


SILU_BLOCK = 1024  # columns per SwiGLU program


class TritonRowOps:
    """RMSNorm, residual add + RMSNorm and SwiGLU for contiguous `[T, size]` rows."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm(x, None, weight, eps)

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of `residual + x`; `residual` becomes that sum (in place)."""
        return self._norm(x, residual, weight, eps)

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        size = x.shape[-1]
        out = torch.empty_like(x)
        rows = x.numel() // size
        if rows:
            _rms_norm_kernel[(rows,)](x, x if residual is None else residual, weight, out, size, eps,
                                      ADD=residual is not None, BLOCK=triton.next_power_of_2(size))
        return out

    def rope_store(self, qkv: torch.Tensor, num_q_heads: int, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, write_slots: torch.Tensor) -> None:
        """Rotate q and k of the merged projection `qkv` `[T, Hq + 2 Hk, D]` (contiguous) in place by
        the whole RoPE tables `cos` / signed `sin` `[max_positions, D]` at `positions` `[T]`, and
        store k and v at `write_slots` `[T]` of the head-major pool `[Hk, num_slots, D]`."""
        num_tokens, num_heads, head_dim = qkv.shape
        if num_tokens:
            _rope_store_kernel[(num_tokens, num_heads)](
                qkv, positions, cos, sin, k_slots, v_slots, write_slots, qkv.stride(0), k_slots.stride(0),
                num_q_heads, (num_heads - num_q_heads) // 2, HEAD_DIM=head_dim,
            )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of `[T, 2 * I]` (gate first) -> `[T, I]`."""
        gate_up = gate_up.contiguous()
        size = gate_up.shape[-1] // 2
        rows = gate_up.numel() // (2 * size)
        out = torch.empty(*gate_up.shape[:-1], size, dtype=gate_up.dtype, device=gate_up.device)
        if rows:
            _silu_mul_kernel[(rows, triton.cdiv(size, SILU_BLOCK))](gate_up, out, size, BLOCK=SILU_BLOCK)
        return out
