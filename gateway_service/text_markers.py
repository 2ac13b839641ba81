"""Markers in streamed text (tags such as `</think>` or `<tool_call>`) that may arrive split over
several pieces."""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `marker`: that
    much text must be held back until the next piece says whether the marker follows."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
