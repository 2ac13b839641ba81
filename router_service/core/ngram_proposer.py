"""Draft tokens from a request's own context: n-gram (prompt) lookup.

The last n tokens of the sequence (prompt + output so far) are looked up in the sequence
itself, longest n first; the tokens that followed their most recent earlier occurrence are the
drafts. Output that quotes its input (editing, answering from a document, repeating a passage)
continues the way the quoted text did, so these drafts are often right, and they cost no model.

The search runs in C: each request's sequence is kept as little-endian 4-byte words in a
`bytearray` (appended to as it grows, never rebuilt), and `bytes.rfind` finds the pattern; a hit
that is not word-aligned is a coincidence of bytes and the search goes on to the left of it.
"""

from __future__ import annotations

import struct

_WORD = 4  # bytes per token id in the encoded sequence


class EncodedSequence:
    """A request's token ids as bytes, kept in step with `token_ids` (which only ever grows)."""

    __slots__ = ("data", "num_tokens")

    def __init__(self) -> None:
        self.data = bytearray()
        self.num_tokens = 0

    def sync(self, token_ids: list[int]) -> None:
        """Encode the tokens appended since the last call."""
        new = token_ids[self.num_tokens:]
        if new:
            self.data += struct.pack(f"<{len(new)}i", *new)
            self.num_tokens = len(token_ids)


def propose(
    sequence: EncodedSequence, token_ids: list[int], max_drafts: int, min_ngram: int, max_ngram: int
) -> list[int]:
    """Up to `max_drafts` tokens that followed the latest earlier match of the longest suffix.

    Tries suffix lengths `max_ngram` down to `min_ngram`; the match must end before the last
    token (so at least one token follows it). Empty when nothing matches or `max_drafts` is 0.
    """
    if max_drafts <= 0:
        return []
    sequence.sync(token_ids)
    num_tokens = len(token_ids)
    data = sequence.data
    for n in range(min(max_ngram, num_tokens - 1), min_ngram - 1, -1):
        pattern = bytes(data[(num_tokens - n) * _WORD:])
        # A match starting at token s (s + n <= num_tokens - 1) lies within the first
        # num_tokens - 1 tokens, which excludes the suffix itself.
        end = (num_tokens - 1) * _WORD
        while True:
            at = data.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % _WORD == 0:
                start = at // _WORD + n
                return token_ids[start : start + max_drafts]
            end = at + len(pattern) - 1  # a misaligned hit: look further left
    return []
