"""One rank's KV page pool: K and V for its own KV heads, every layer, every page.

Page ids are the router's; they mean the same on every rank. Storage is one tensor
`[2, num_layers, local_kv_heads, num_pages * page_size, head_dim]`: for each head, a layer's K (or
V) is a flat array of slots (`slot = page_id * page_size + offset`). A model whose values are its
keys (DeepSeek's latent row, `models/mla.py`) keeps one copy: `[1, ...]`, V a view of K (what a
backend writes to V is what it wrote to K). New tokens are written with
one `index_copy_`, a sequence's context is gathered with one `index_select` of whole pages, and
because the layout is head-major, what a gather returns is already each head's keys in a row, the
layout attention's batched matmuls read (`attention/kernels.py`).
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # Linux


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back `tensor`'s (untouched) memory with 2 MiB pages; False where it cannot.

    The router hands out pages from anywhere in the pool, so a step reads thousands of short
    runs (one page of one head, 2 KiB for SmolLM2 in bfloat16) scattered over the pool: with
    4 KiB pages nearly every run is also a TLB miss.
    """
    if not sys.platform.startswith("linux"):
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = (start + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(first, last - first, MADV_HUGEPAGE) == 0


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        values_are_keys: bool = False,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"the KV budget holds no page (num_pages={num_pages})")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.values_are_keys = values_are_keys
        self.buffer = torch.empty(
            (1 if values_are_keys else 2, num_layers, num_kv_heads, num_pages * page_size, head_dim),
            dtype=dtype, device=device,
        )
        if self.buffer.device.type == "cpu":
            advise_huge_pages(self.buffer)  # before the first touch, which zero_ is
        self.buffer.zero_()
        # Made once: every layer of every step asks for its views.
        self._values = 0 if values_are_keys else 1
        self._layer_slots = [(self.buffer[0, layer], self.buffer[self._values, layer]) for layer in range(num_layers)]

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        values_are_keys: bool = False,
    ) -> int:
        """K and V (K alone where `values_are_keys`) of one page over all layers."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return (1 if values_are_keys else 2) * num_layers * page_size * num_kv_heads * head_dim * element_size

    @classmethod
    def pages_for_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        values_are_keys: bool = False,
    ) -> int:
        """How many whole pages fit in `budget_bytes`."""
        return budget_bytes // cls.bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype,
                                                  values_are_keys)

    def slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V, each `[num_kv_heads, num_slots, head_dim]` (views)."""
        return self._layer_slots[layer]

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V as `[num_kv_heads, num_pages, page_size, head_dim]` (views)."""
        shape = (self.num_kv_heads, self.num_pages, self.page_size, self.head_dim)
        return self.buffer[0, layer].view(shape), self.buffer[self._values, layer].view(shape)
