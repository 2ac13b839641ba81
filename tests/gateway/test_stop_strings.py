"""Stop strings across piece (token) boundaries, as a pure unit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway_service.stop_strings import StopStringMatcher


def run(stop: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    matcher = StopStringMatcher(stop)
    emitted = []
    for piece in pieces:
        result = matcher.feed(piece)
        emitted.append(result.text)
        if result.stopped:
            return emitted, True
    tail = matcher.flush()
    emitted.append(tail.text)
    return emitted, tail.stopped


def test_stop_split_over_pieces_cuts_before_it():
    emitted, stopped = run(["</end>"], ["Hello </", "e", "nd> tail"])
    assert stopped and "".join(emitted) == "Hello "
    # Nothing that could still start the stop string was emitted early.
    assert emitted[:2] == ["Hello ", ""]


def test_held_prefix_is_released_when_it_turns_out_not_to_be_a_stop():
    emitted, stopped = run(["STOP"], ["a ST", "ORM b"])
    assert not stopped and emitted == ["a ", "STORM b", ""]


def test_held_text_comes_out_at_the_end():
    emitted, stopped = run(["STOP"], ["x ST"])
    assert not stopped and emitted == ["x ", "ST"]


def test_earliest_of_several_stops_wins():
    emitted, stopped = run(["world", "lo w"], ["hello world"])
    assert stopped and "".join(emitted) == "hel"


def test_a_stop_that_starts_earlier_wins_over_one_that_completed_first():
    # "b" is complete after "XXb", but "XbX" starts one character earlier and completes next.
    emitted, stopped = run(["b", "XbX"], ["XXb", "X"])
    assert stopped and "".join(emitted) == "X"


def test_a_complete_stop_held_behind_a_partial_one_ends_the_output_at_flush():
    emitted, stopped = run(["b", "XbX"], ["XXb"])
    assert stopped and "".join(emitted) == "XX"


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopStringMatcher([""])


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abcXY", max_size=30),
    stop=st.lists(st.text(alphabet="abcXY", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
)
def test_any_split_gives_the_text_before_the_first_stop(text, stop, cuts):
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    emitted, stopped = run(stop, pieces)
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    expected = text[: min(hits)] if hits else text
    assert "".join(emitted) == expected
    assert stopped == bool(hits)
