"""Stop strings matched on the text stream, across token boundaries.

Text is fed as it is detokenized. The matcher emits text only once it can no longer be the
start of a stop string: a tail of the text that is a prefix of some stop string is held back
until later text settles it. When a stop string appears, the text before its first occurrence
is emitted and the rest (the stop string included) is dropped. "First" means the earliest
*start*: a complete stop string does not end the output while an earlier-starting one may
still complete (stops `b` and `XbX` over `XXb` + `X` cut after the first `X`), so its text is
held until later text or the end of the output decides.
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
        limit = len(buffer) if cut is None else cut
        pending = self._first_partial_stop(buffer, limit)
        if pending is not None:  # may still become a stop that starts before `cut`
            self._held = buffer[pending:]
            return StopResult(buffer[:pending], False)
        self._held = ""
        if cut is not None:
            self.stopped = True
            return StopResult(buffer[:cut], True)
        return StopResult(buffer, False)

    def flush(self) -> StopResult:
        """The end of the output: the held-back text up to the first stop string in it."""
        if self.stopped:
            return StopResult("", True)
        held, self._held = self._held, ""
        cut = self._first_stop(held)
        if cut is None:
            return StopResult(held, False)
        self.stopped = True
        return StopResult(held[:cut], True)

    def _first_stop(self, text: str) -> int | None:
        positions = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(positions) if positions else None

    def _first_partial_stop(self, text: str, limit: int) -> int | None:
        """The earliest position before `limit` where a tail of `text` is a proper prefix of a
        stop string (a stop that later text may complete), or None."""
        for start in range(max(0, len(text) - self._max_len + 1), limit):
            tail = text[start:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self._stop):
                return start
        return None
