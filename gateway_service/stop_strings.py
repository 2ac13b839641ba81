"""Stop strings matched on the text stream, across token boundaries.

Text is fed as it is detokenized. The matcher emits text only once it can no longer be the
start of a stop string: a tail of the text that is a prefix of some stop string is held back
until later text settles it. When a stop string appears, the text before its first occurrence
is emitted and the rest (the stop string included) is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopResult:
    """Text now safe to emit, and whether a stop string ended the output."""

    text: str
    stopped: bool


class StopStringMatcher:
    """Invariant: emitted text never contains a stop string, and no stop string starts inside
    emitted text (its prefixes are always held back)."""

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        self._max_len = max((len(s) for s in self._stop), default=0)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> StopResult:
        if self.stopped:
            return StopResult("", True)
        buffer = self._held + text
        cut = self._first_stop(buffer)
        if cut is not None:
            self._held = ""
            self.stopped = True
            return StopResult(buffer[:cut], True)
        keep = self._partial_stop_len(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return StopResult(buffer[:len(buffer) - keep], False)

    def flush(self) -> str:
        """The held-back text at the end of the output (it turned out not to be a stop)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_stop(self, text: str) -> int | None:
        positions = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(positions) if positions else None

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        for length in range(min(len(text), self._max_len - 1), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self._stop):
                return length
        return 0
