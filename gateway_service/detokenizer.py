"""Incremental detokenization: token ids in, text pieces out, as tokens arrive.

A byte-level BPE token can hold part of a UTF-8 character (an emoji or a CJK character is
often split over two or three tokens), and decoding it alone yields U+FFFD. The detokenizer
decodes a small window of recent tokens and emits only text that cannot change any more.

Invariants:
- no piece ends in the middle of a character: text whose decoding ends in U+FFFD is held
  back until a later token completes it (or `flush` gives it up at the end);
- `"".join(pieces) + flush()` equals `decode(all token ids)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids one at a time with `add`; call `flush` once at the end.

    `prefix_offset .. read_offset` are tokens already emitted, kept as left context so the
    window decodes the way the whole sequence would (leading-space rules, byte merges);
    tokens from `read_offset` on are not emitted yet.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], decode_one: Callable[[int], str] | None = None) -> None:
        """`decode_one(t)`, where given, is `decode([t])` (a cheaper way to the same text)."""
        self._decode = decode
        self._decode_one = decode_one
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    @property
    def window(self) -> int:
        """Tokens the next `add` decodes besides its own (the left context and what is held back)."""
        return len(self._token_ids) - self._prefix_offset

    def add(self, token_id: int) -> str:
        """Append one token; return the text that is now final (possibly empty)."""
        token_ids = self._token_ids
        token_ids.append(token_id)
        start, end = self._prefix_offset, self._read_offset
        # The left context is the one token emitted last at almost every step.
        if end - start == 1 and self._decode_one is not None:
            prefix_text = self._decode_one(token_ids[start])
        else:
            prefix_text = self._decode(token_ids[start:end])
        full_text = self._decode(token_ids[start:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            # Nothing new, or the newest bytes do not make a whole character yet.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """The held-back text, incomplete characters included (as U+FFFD)."""
        prefix_text = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._token_ids)
        return full_text[len(prefix_text):]
