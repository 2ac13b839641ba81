"""The n-gram proposer: longest suffix first, latest earlier match, word-aligned hits only."""

from __future__ import annotations

from router_service.core.ngram_proposer import EncodedSequence, propose


def drafts(token_ids: list[int], k: int = 4, min_ngram: int = 1, max_ngram: int = 3) -> list[int]:
    return propose(EncodedSequence(), token_ids, k, min_ngram, max_ngram)


def test_the_longest_matching_suffix_wins_over_a_later_shorter_one() -> None:
    # Suffix (1, 2, 3) matched at the start (followed by 10, 11); the later (2, 3) by 20.
    tokens = [1, 2, 3, 10, 11, 9, 2, 3, 20, 9, 1, 2, 3]
    assert drafts(tokens) == [10, 11, 9, 2]
    assert drafts(tokens, max_ngram=2) == [20, 9, 1, 2]


def test_the_latest_earlier_match_is_used_and_k_bounds_the_drafts() -> None:
    tokens = [7, 8, 1, 7, 8, 2, 7, 8]
    assert drafts(tokens, k=1, max_ngram=2) == [2]
    assert drafts(tokens, k=10, max_ngram=2) == [2, 7, 8]
    assert drafts(tokens, k=0) == []


def test_no_match_or_too_short_gives_nothing() -> None:
    assert drafts([1, 2, 3, 4]) == []
    assert drafts([5]) == []
    assert drafts([5, 5], min_ngram=2) == []
    assert drafts([5, 5]) == [5]


def test_byte_coincidences_across_token_boundaries_are_not_matches() -> None:
    # 0x100 then 0 encode as 00 01 00 00 | 00 00 00 00: one byte in, they read 01 00 00 00,
    # which is token 1. Only word-aligned hits count, so the search goes on to the left.
    assert drafts([0x100, 0, 5, 1], max_ngram=1) == []
    assert drafts([1, 9, 0x100, 0, 5, 1], max_ngram=1) == [9, 0x100, 0, 5]


def test_the_encoding_follows_a_growing_sequence() -> None:
    sequence = EncodedSequence()
    tokens = [4, 5, 6]
    assert propose(sequence, tokens, 3, 1, 2) == []
    tokens += [4, 5]
    assert propose(sequence, tokens, 3, 1, 2) == [6, 4, 5]
    tokens += [9]
    assert propose(sequence, tokens, 3, 1, 2) == []
    assert sequence.num_tokens == len(tokens)
