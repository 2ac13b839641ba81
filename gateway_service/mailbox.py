"""A mailbox with one reader: items put by callbacks and other tasks of the event loop, taken
all at once.

Streams put one item per request per router message (and the HTTP API one per chunk of each
choice), so the reader waits on a bare future rather than an `asyncio.Event` or
`asyncio.Queue`, whose waits and wake-ups keep lists of waiters for many readers.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    """Made inside the event loop it is used on; `take` has one caller at a time."""

    __slots__ = ("_items", "_waiter", "_loop")

    def __init__(self) -> None:
        self._items: list[T] = []
        self._waiter: asyncio.Future | None = None
        self._loop = asyncio.get_running_loop()

    def put(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __len__(self) -> int:
        """Items put and not yet taken."""
        return len(self._items)

    def parked(self) -> bool:
        """Whether the reader waits in `take` and nothing was put since it began to (so what is
        handed to it another way now cannot pass an item put before)."""
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def take_nowait(self) -> list[T]:
        """Everything put since the last take (perhaps nothing)."""
        items, self._items = self._items, []
        return items

    async def take(self) -> list[T]:
        """Everything put since the last take, in order (waits for at least one item)."""
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items
