"""Incremental detokenization with the real SmolLM2 tokenizer: whole characters only, and the
pieces add up to decoding everything at once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway_service.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer


def pieces_for(tokenizer, token_ids: list[int]) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer.decode)
    pieces = [detok.add(t) for t in token_ids]
    return pieces, detok.flush()


def test_emoji_and_cjk_split_over_tokens_are_never_emitted_half(tokenizer):
    text = "Hi 😀🎉 世界, naïve café — 한국어 ok"
    ids = tokenizer.encode_prompt(text)
    # The point of the test: some tokens alone decode to a broken character.
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids)
    pieces, tail = pieces_for(tokenizer, ids)
    assert "".join(pieces) + tail == text == tokenizer.decode(ids)
    assert tail == ""
    assert not any(REPLACEMENT_CHAR in p for p in pieces)
    # The emoji's first token is held back (""); the character comes out whole with the next.
    emoji_at = next(i for i, p in enumerate(pieces) if "😀" in p)
    assert pieces[emoji_at - 1] == ""


def test_special_tokens_are_left_out(tokenizer):
    ids = tokenizer.encode_prompt("done") + [2]
    pieces, tail = pieces_for(tokenizer, ids)
    assert "".join(pieces) + tail == "done"


def test_incomplete_character_at_the_end_is_flushed(tokenizer):
    ids = tokenizer.encode_prompt("a😀")
    pieces, tail = pieces_for(tokenizer, ids[:-1])
    assert "".join(pieces) == "a"
    assert tail == tokenizer.decode(ids[:-1])[1:]
    assert tail.endswith(REPLACEMENT_CHAR)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_pieces_join_to_the_whole_decode(tokenizer, text):
    ids = tokenizer.encode_prompt(text)
    pieces, tail = pieces_for(tokenizer, ids)
    assert "".join(pieces) + tail == tokenizer.decode(ids)
    assert not any(p.endswith(REPLACEMENT_CHAR) for p in pieces)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=49151), max_size=30))
def test_arbitrary_token_ids_join_to_the_whole_decode(tokenizer, ids):
    pieces, tail = pieces_for(tokenizer, ids)
    assert "".join(pieces) + tail == tokenizer.decode(ids)
    assert not any(p.endswith(REPLACEMENT_CHAR) for p in pieces)
