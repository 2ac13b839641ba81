"""Incremental detokenization with the real SmolLM2 tokenizer: whole characters only, and the
pieces add up to decoding everything at once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway_service.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer


def pieces_for(tokenizer, token_ids: list[int], remembered: bool = True) -> tuple[list[str], str]:
    """As the gateway detokenizes (`remembered`: single tokens' text looked up, `decode_one`)."""
    detok = IncrementalDetokenizer(tokenizer.decode, tokenizer.decode_one if remembered else None)
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


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=49151), max_size=30))
def test_remembered_single_tokens_give_the_same_pieces(tokenizer, ids):
    assert pieces_for(tokenizer, ids) == pieces_for(tokenizer, ids, remembered=False)


def test_a_special_token_kept_after_its_text_was_remembered_is_output(tokenizer):
    """`keep_special` forgets what `decode_one` remembered: a kept special token's text is
    output from then on, also as the detokenizer's left context."""
    from gateway_service.tokenizer import Tokenizer

    fresh = Tokenizer(tokenizer.hf)
    special = fresh.hf.convert_tokens_to_ids("<|im_start|>")
    assert fresh.decode_one(special) == ""  # skipped, and remembered
    assert fresh.keep_special("<|im_start|>") == special
    assert fresh.decode_one(special) == "<|im_start|>" == fresh.decode([special])
    ids = [special, *fresh.encode_prompt("ok"), special]
    pieces, tail = pieces_for(fresh, ids)
    assert "".join(pieces) + tail == fresh.decode(ids) == "<|im_start|>ok<|im_start|>"


def test_window_holds_what_is_held_back_and_shrinks_once_text_is_out(tokenizer):
    lead_byte = next(t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) == REPLACEMENT_CHAR)
    detok = IncrementalDetokenizer(tokenizer.decode)
    for count in range(1, 41):  # lone lead bytes never complete a character: all is held back
        assert detok.add(lead_byte) == ""
        assert detok.window == count
    detok.add(tokenizer.encode_prompt(" ok")[-1])
    assert detok.window <= 41 and detok.add(tokenizer.encode_prompt(" yes")[-1]) != ""
    assert detok.window <= 2  # the emitted text is no longer decoded again


def test_only_small_output_work_runs_on_the_event_loop(tokenizer):
    """`is_cheap` picks the event loop for a decode step's token or few over a short window and
    few logprob texts; long chunks, a long held-back window and many top logprobs go to threads."""
    from gateway_service.output import CHEAP_TEXTS, CHEAP_TOKENS, CHEAP_WINDOW, OutputAssembler
    from radixserve.v1 import generation_pb2

    ids = tokenizer.encode_prompt("one two three four five six seven")
    assembler = OutputAssembler(tokenizer, [], 3)
    assert assembler.is_cheap(ids[:1]) and assembler.is_cheap(ids[:CHEAP_TOKENS])
    assert not assembler.is_cheap(ids[:CHEAP_TOKENS + 1])
    logprob = generation_pb2.TokenLogprob(token_id=ids[0], top_logprobs=[
        generation_pb2.TopLogprob(token_id=ids[k % len(ids)]) for k in range(CHEAP_TEXTS)])
    assert not assembler.is_cheap(ids[:1], [logprob])  # 1 + CHEAP_TEXTS texts
    del logprob.top_logprobs[1:]
    assert assembler.is_cheap(ids[:1], [logprob])
    lead_byte = next(t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) == REPLACEMENT_CHAR)
    for _ in range(CHEAP_WINDOW + 1):
        assembler.add([lead_byte])
    assert not assembler.is_cheap(ids[:1])  # the next add would decode the whole held-back run


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=49151), max_size=30))
def test_decoding_matches_the_transformers_tokenizer(tokenizer, ids):
    """The gateway decodes with the fast tokenizer's own (Rust) decoder: the text must be what
    transformers' `decode` gives, with and without special tokens."""
    assert tokenizer.decode(ids) == tokenizer.hf.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode_all(ids) == tokenizer.hf.decode(ids, skip_special_tokens=False)
    assert [tokenizer.token_text(t) for t in ids[:5]] == [tokenizer.hf.decode([t]) for t in ids[:5]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(min_value=0, max_value=49151), min_size=1, max_size=4), max_size=12),
       st.sampled_from([(), ("e",), (" the", "\n")]))
def test_plain_tokens_make_the_chunks_the_general_way_makes(tokenizer, groups, stop):
    """`OutputAssembler.add_plain` (bare tokens) gives the chunks `add` gives for the same tokens
    with nothing else new, stop strings or not, and ends the same."""
    from gateway_service.output import OutputAssembler

    plain, general = OutputAssembler(tokenizer, stop, 5), OutputAssembler(tokenizer, stop, 5)
    for group in groups:
        if general.finished:
            break
        assert plain.add_plain(group) == general.add(group)
        assert plain.num_completion_tokens == general.num_completion_tokens
    if not general.finished:
        assert plain.add([2], finish_reason=1) == general.add([2], finish_reason=1)
