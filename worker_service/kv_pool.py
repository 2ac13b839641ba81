"""One rank's KV page pool: K and V for its own KV heads, every layer, every page.

Page ids are the router's; they mean the same on every rank. Storage is one tensor
`[2, num_layers, local_kv_heads, num_pages * page_size, head_dim]`: for each head, a layer's K (or
V) is a flat array of slots (`slot = page_id * page_size + offset`). New tokens are written with
one `index_copy_`, a sequence's context is gathered with one `index_select` of whole pages, and
because the layout is head-major, what a gather returns is already each head's keys in a row, the
layout attention's batched matmuls read (`attention/kernels.py`).
"""

from __future__ import annotations

import torch


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
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"the KV budget holds no page (num_pages={num_pages})")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.buffer = torch.zeros(
            (2, num_layers, num_kv_heads, num_pages * page_size, head_dim), dtype=dtype, device=device
        )
        # Made once: every layer of every step asks for its views.
        self._layer_slots = [(self.buffer[0, layer], self.buffer[1, layer]) for layer in range(num_layers)]

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """K and V of one page over all layers."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * element_size

    @classmethod
    def pages_for_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many whole pages fit in `budget_bytes`."""
        return budget_bytes // cls.bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype)

    def slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V, each `[num_kv_heads, num_slots, head_dim]` (views)."""
        return self._layer_slots[layer]

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V as `[num_kv_heads, num_pages, page_size, head_dim]` (views)."""
        shape = (self.num_kv_heads, self.num_pages, self.page_size, self.head_dim)
        return self.buffer[0, layer].view(shape), self.buffer[1, layer].view(shape)
