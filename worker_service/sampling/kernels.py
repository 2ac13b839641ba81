"""Rank 0's sampling kernels (`csrc/penalties.cpp`, `csrc/sample.cpp`, `csrc/logprobs.cpp`) over
float32 CPU logits, called through the compiled library (`worker_service.native`). Each leaves rows
it cannot take (a NaN or +inf logit, nothing but -inf) for the torch path to answer, and says
which; `ops.KernelSampling` is where those rows go to PyTorch.
"""

from __future__ import annotations

import ctypes

import torch


# The most top logprobs the logprobs kernel keeps per row (`kMaxTop` in csrc/logprobs.cpp); requests
# ask for at most `radixserve.sampling.MAX_TOP_LOGPROBS`.
KERNEL_MAX_TOP = 64


class SamplingKernels:
    """The sampling kernels of one loaded build."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        """`lib`: the loaded library (`NativeKernels.lib`), its functions typed by
        `worker_service.native.signatures`."""
        self._argmax_rows = lib.radix_argmax_rows
        self._sample_rows = lib.radix_sample_rows
        self._apply_penalties = lib.radix_apply_penalties
        self._logprobs = lib.radix_logprobs

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """torch.argmax(x, dim=-1) of float32 CPU rows `x` `[rows, cols]` (the first index of the
        maximum), as int64; None where a row holds a NaN (torch's argmax then says where)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        status = self._argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(),
                                   torch.get_num_threads())
        return out if status == 0 else None

    def sample_rows(self, x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """One token per float32 CPU row of `x` `[rows, cols]`: the argmax where `temperature` is 0,
        else the draw at that temperature after `top_k` (int32, 0: off), `top_p` (1: off) and
        `min_p` (0: off; all three float32 per row) with the float64 `uniform` number in [0, 1) (see
        `csrc/sample.cpp`), as int64; -1 for a row holding a NaN or +inf or only -inf."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        for name, values, dtype in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
                                    ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32),
                                    ("uniform", uniform, torch.float64)):
            if values.dtype != dtype or values.shape != (rows,) or not values.is_contiguous():
                raise TypeError(f"{name} must be a contiguous {dtype} vector of {rows}")
        out = torch.empty(rows, dtype=torch.int64)
        self._sample_rows(x.data_ptr(), x.stride(0), rows, x.shape[1], temperature.data_ptr(), top_k.data_ptr(),
                          top_p.data_ptr(), min_p.data_ptr(), uniform.data_ptr(), out.data_ptr(),
                          torch.get_num_threads())
        return out

    def apply_penalties(self, x: torch.Tensor, histories: list[tuple[int, int, int]], repetition: torch.Tensor,
                        presence: torch.Tensor, frequency: torch.Tensor) -> None:
        """Penalise float32 CPU rows `x` `[rows, cols]` in place (see `csrc/penalties.cpp`).

        `histories[r]` is row r's token history as (address of its int32 token ids, how many,
        how many of them are prompt); the three penalties are float32 per row (1, 0, 0: off).
        Raises ValueError, leaving those rows untouched, where a token id is outside [0, cols).
        """
        rows = x.shape[0]
        if x.dtype != torch.float32 or x.stride(-1) != 1 or len(histories) != rows:
            raise TypeError(f"penalties take contiguous float32 rows and one history per row ({len(histories)} "
                            f"for {tuple(x.shape)})")
        for name, values in (("repetition", repetition), ("presence", presence), ("frequency", frequency)):
            if values.dtype != torch.float32 or values.shape != (rows,) or not values.is_contiguous():
                raise TypeError(f"{name} must be a contiguous float32 vector of {rows}")
        addresses = (ctypes.c_void_p * rows)(*(address or None for address, _, _ in histories))
        counts = torch.tensor([count for _, count, _ in histories], dtype=torch.int32)
        prompts = torch.tensor([prompt for _, _, prompt in histories], dtype=torch.int32)
        bad = self._apply_penalties(x.data_ptr(), x.stride(0), rows, x.shape[1], addresses, counts.data_ptr(),
                                    prompts.data_ptr(), repetition.data_ptr(), presence.data_ptr(),
                                    frequency.data_ptr(), torch.get_num_threads())
        if bad:
            raise ValueError(f"{bad} row(s) hold token ids outside [0, {x.shape[1]})")

    def logprobs(self, x: torch.Tensor, row_ids: torch.Tensor, chosen: torch.Tensor, num_top: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The log-softmax of float32 CPU rows `x[row_ids]` (int64 row numbers; read in place, not
        gathered) at the int64 tokens `chosen`, and each such row's `num_top` (at most KERNEL_MAX_TOP) largest
        log-softmax values with their ids, largest first: `(chosen_logprobs [n], top_ids [n,
        num_top], top_values [n, num_top])` for n = len(row_ids). None where some row holds a NaN or
        +inf or only -inf (the torch path then gives what such rows give)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = row_ids.shape[0]
        for name, values in (("row_ids", row_ids), ("chosen", chosen)):
            if values.dtype != torch.int64 or values.shape != (rows,) or not values.is_contiguous():
                raise TypeError(f"{name} must be a contiguous int64 vector of {rows}")
        if rows and not (0 <= int(row_ids.min()) and int(row_ids.max()) < x.shape[0]):
            raise IndexError(f"row numbers outside [0, {x.shape[0]})")
        most = min(KERNEL_MAX_TOP, x.shape[1])
        if not 0 <= num_top <= most:
            raise ValueError(f"num_top {num_top} is outside [0, {most}]")
        chosen_out = torch.empty(rows, dtype=torch.float32)
        top_ids = torch.empty((rows, num_top), dtype=torch.int64)
        top_values = torch.empty((rows, num_top), dtype=torch.float32)
        left = self._logprobs(x.data_ptr(), x.stride(0), row_ids.data_ptr(), rows, x.shape[1], chosen.data_ptr(),
                              chosen_out.data_ptr(), num_top, top_ids.data_ptr(), top_values.data_ptr(),
                              torch.get_num_threads())
        return None if left else (chosen_out, top_ids, top_values)
