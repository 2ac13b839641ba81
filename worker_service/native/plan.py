"""One step's plan for the compiled attention kernel (`csrc/paged_attention.cpp`).

The compiled-kernels backend describes the step once (each decode row's pages and context length, the groups
of rows sharing leading pages, the prefill spans); `build_plan` lays it out as the C++ `StepPlan`
expects, in one int32 tensor the struct points into. Every layer then attends through the same
`NativePlan`: the first fills in the layout and has the library build the step's schedule.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
import torch

from worker_service.native.signatures import DTYPE_CODES

_INT32_P = ctypes.POINTER(ctypes.c_int32)


class PlanStruct(ctypes.Structure):
    """Mirror of `StepPlan` in paged_attention.cpp (checked against the library's own size)."""

    _fields_ = [
        ("num_rows", ctypes.c_int32), ("num_q_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32), ("page_size", ctypes.c_int32), ("dtype", ctypes.c_int32),
        ("q_row_stride", ctypes.c_int64), ("kv_head_stride", ctypes.c_int64),
        ("scale", ctypes.c_float), ("num_threads", ctypes.c_int32),
        ("row_page_start", _INT32_P), ("row_pages", _INT32_P), ("seq_lens", _INT32_P),
        ("row_prefix_pages", _INT32_P),
        ("num_groups", ctypes.c_int32),
        ("group_row_start", _INT32_P), ("group_rows", _INT32_P), ("group_num_pages", _INT32_P),
        ("num_spans", ctypes.c_int32),
        ("span_first_row", _INT32_P), ("span_num_rows", _INT32_P), ("span_start", _INT32_P),
        ("span_page_start", _INT32_P), ("span_pages", _INT32_P),
    ]


def build_plan(lib: ctypes.CDLL, tables: list[list[int]], context_lens: list[int], page_size: int,
               groups: list[tuple[list[int], int]], spans: list[tuple[int, int, int, list[int]]] = ()) -> NativePlan:
    """See `NativeKernels.plan` (`lib`: the loaded library)."""
    pages: list[int] = []
    page_start = [0]
    for table, length in zip(tables, context_lens):
        pages.extend(table[: (length + page_size - 1) // page_size])
        page_start.append(len(pages))
    prefix_pages = [0] * len(tables)
    group_rows: list[int] = []
    group_row_start = [0]
    for rows, num_pages in groups:
        for row in rows:
            prefix_pages[row] = num_pages
        group_rows.extend(rows)
        group_row_start.append(len(group_rows))
    span_pages: list[int] = []
    span_page_start = [0]
    for _, _, _, span_table in spans:
        span_pages.extend(span_table)
        span_page_start.append(len(span_pages))
    arrays = {
        "row_page_start": page_start, "row_pages": pages, "seq_lens": context_lens,
        "row_prefix_pages": prefix_pages, "group_row_start": group_row_start, "group_rows": group_rows,
        "group_num_pages": [num_pages for _, num_pages in groups],
        "span_first_row": [span[0] for span in spans], "span_num_rows": [span[1] for span in spans],
        "span_start": [span[2] for span in spans], "span_page_start": span_page_start, "span_pages": span_pages,
    }
    # One int32 tensor holds every array; the plan's pointers point into it.
    flat: list[int] = []
    offsets = []
    for array in arrays.values():
        offsets.append(len(flat))
        flat.extend(array)
    storage = torch.tensor(flat or [0], dtype=torch.int32)
    struct = PlanStruct(num_rows=len(tables), page_size=page_size, num_groups=len(groups),
                         num_spans=len(spans))
    base = storage.data_ptr()
    for name, offset in zip(arrays, offsets):
        setattr(struct, name, ctypes.cast(base + 4 * offset, _INT32_P))
    num_rows = max([len(tables)] + [first + count for first, count, _, _ in spans])
    return NativePlan(lib, struct, storage, num_rows)


@dataclass(slots=True)
class NativePlan:
    """One step's plan for the kernel; `attend` runs one layer. Holds the arrays it points into.

    The first layer fills in the layout (heads, strides, dtype) and has the library build the
    step's schedule (segments, chunks, which partials each row merges); every other layer of the
    step has the same layout and reuses both.
    """

    lib: ctypes.CDLL  # the library, typed and checked by `signatures.py`
    _struct: PlanStruct
    _storage: torch.Tensor
    num_rows: int
    _layout: tuple | None = None
    _schedule: int | None = None  # the library's schedule for `_layout`

    def attend(self, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Queries `q` `[rows, Hq, D]` over one layer's head-major pool `[Hk, num_slots, D]` -> `[rows, Hq, D]`,
        with `sinks` (float32 `[Hq]`, `AttentionOptions.sinks`) where given.

        Every row's K/V (a prefill row's own included) must already be in the pool.
        """
        num_rows, num_q_heads, head_dim = q.shape
        if num_rows != self.num_rows:
            raise ValueError(f"the plan has {self.num_rows} rows, q has {num_rows}")
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        layout = (num_q_heads, head_dim, q.dtype, q.stride(0), k_slots.shape[0], k_slots.stride(0))
        if layout != self._layout:
            self._bind(layout)
        out = torch.empty((num_rows, num_q_heads, head_dim), dtype=q.dtype)
        if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (num_q_heads,)
                                  or not sinks.is_contiguous()):
            raise ValueError(f"sinks must be float32 [{num_q_heads}], contiguous")
        self.lib.radix_paged_attention(ctypes.addressof(self._struct), self._schedule, q.data_ptr(),
                                       k_slots.data_ptr(), v_slots.data_ptr(), out.data_ptr(),
                                       None if sinks is None else sinks.data_ptr())
        return out

    def bound(self, num_q_heads: int, head_dim: int, dtype: torch.dtype, q_row_stride: int, num_kv_heads: int,
              kv_head_stride: int) -> tuple[int, int]:
        """The plan's struct and schedule addresses for this layout (bound now if it differs), for
        callers that run the kernel from compiled code (`backends/fused_llama.py`)."""
        layout = (num_q_heads, head_dim, dtype, q_row_stride, num_kv_heads, kv_head_stride)
        if layout != self._layout:
            self._bind(layout)
        return ctypes.addressof(self._struct), self._schedule

    def _bind(self, layout: tuple) -> None:
        struct = self._struct
        num_q_heads, head_dim, dtype, q_row_stride, num_kv_heads, kv_head_stride = layout
        struct.num_q_heads, struct.head_dim, struct.dtype = num_q_heads, head_dim, DTYPE_CODES[dtype]
        struct.q_row_stride, struct.num_kv_heads, struct.kv_head_stride = q_row_stride, num_kv_heads, kv_head_stride
        struct.scale = head_dim ** -0.5
        struct.num_threads = torch.get_num_threads()
        self._release()
        self._schedule = self.lib.radix_schedule(ctypes.addressof(struct))
        if not self._schedule:
            raise ValueError(f"{num_q_heads} query heads do not group over {num_kv_heads} KV heads")
        self._layout = layout

    def _release(self) -> None:
        if self._schedule:
            self.lib.radix_free_schedule(self._schedule)
        self._schedule = None

    def __del__(self) -> None:
        self._release()
