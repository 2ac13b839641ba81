"""The page allocator: which of the workers' KV pages are free.

The router owns every page id in `[0, num_pages)`. A page is either free (here) or held by
someone else: a running request's page table or the radix cache. Freeing a page twice, or a
page id that was never handed out, is a bookkeeping bug and raises at once rather than
corrupting another request's K/V later.
"""

from __future__ import annotations


class OutOfPages(Exception):
    """`alloc` was asked for more pages than are free."""


class PageAllocator:
    """A LIFO free list of page ids.

    Invariant: `num_free + num_used == num_pages`, and a page id is free at most once.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        # Reversed so that the first allocations hand out 0, 1, 2, ... (easier to read in logs).
        self._free_ids = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free_ids)

    def alloc(self, num: int) -> list[int]:
        """Take `num` free pages; raises `OutOfPages` (taking none) when fewer are free."""
        if num < 0:
            raise ValueError(f"cannot allocate {num} pages")
        if num > len(self._free_ids):
            raise OutOfPages(f"asked for {num} pages, {len(self._free_ids)} free")
        if num == 0:
            return []
        page_ids = self._free_ids[-num:]
        del self._free_ids[-num:]
        for page_id in page_ids:
            self._is_free[page_id] = 0
        return page_ids

    def free(self, page_ids: list[int]) -> None:
        """Give pages back; a foreign id or a page that is already free raises `ValueError`.

        The check happens before anything changes, so a failed call frees nothing.
        """
        seen: set[int] = set()
        for page_id in page_ids:
            if not 0 <= page_id < self.num_pages:
                raise ValueError(f"page {page_id} is not in [0, {self.num_pages})")
            if self._is_free[page_id] or page_id in seen:
                raise ValueError(f"page {page_id} freed twice")
            seen.add(page_id)
        for page_id in page_ids:
            self._is_free[page_id] = 1
        self._free_ids.extend(page_ids)

    def is_free(self, page_id: int) -> bool:
        return bool(self._is_free[page_id])
