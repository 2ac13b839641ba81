"""Tokenizer work off the event loop.

Tokenizing a long prompt, rendering a chat template or decoding a batch of tokens takes from
microseconds to a second, and the event loop serves every open stream: none of it runs there,
except a decode step's few tokens over a short window (`OutputAssembler.is_cheap`: a few
microseconds, less than the hand-off to a thread and back).
Encoding (chat template included) and decoding get a pool each, so a long prompt being tokenized
never delays the text of a stream that is already running. The Hugging Face fast tokenizer
releases the GIL while it encodes, so the loop keeps running meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class TextPool:
    def __init__(self, num_threads: int) -> None:
        self._encode = ThreadPoolExecutor(num_threads, thread_name_prefix="encode")
        self._decode = ThreadPoolExecutor(num_threads, thread_name_prefix="decode")

    async def encode(self, fn: Callable[..., T], *args) -> T:
        """Run `fn(*args)` (tokenization, chat template) on the encode threads."""
        return await asyncio.get_running_loop().run_in_executor(self._encode, fn, *args)

    async def decode(self, fn: Callable[..., T], *args) -> T:
        """Run `fn(*args)` (detokenization, token text) on the decode threads."""
        return await asyncio.get_running_loop().run_in_executor(self._decode, fn, *args)

    def close(self) -> None:
        """Let the threads go once what they run now is done; nothing new is accepted."""
        self._encode.shutdown(wait=False, cancel_futures=True)
        self._decode.shutdown(wait=False, cancel_futures=True)
