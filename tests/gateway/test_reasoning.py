"""The reasoning split: a leading `<think>` block goes to reasoning, the rest to content, for any
way the text arrives in pieces (tags split anywhere), and for a prompt that already opened the
block; text that is not a leading block is all content."""

from __future__ import annotations

import pytest

from gateway_service.reasoning import ReasoningSplitter, detect_reasoning, opens_inside_block

CASES = [
    # (starts inside, output, reasoning, content)
    (False, "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "\nThe user wants 2+2.\n", "It is 4."),
    (False, "\n<think>a < b </thin k></think>done", "a < b </thin k>", "done"),
    (False, "It is 4. <think>not a leading block</think>", "", "It is 4. <think>not a leading block</think>"),
    (False, "<think>cut off by max_tokens", "cut off by max_tokens", ""),
    (False, "<thi", "", "<thi"),
    (False, "", "", ""),
    (True, "still thinking</think>\n\nanswer", "still thinking", "answer"),
    (True, "no end", "no end", ""),
]


def _run(starts_inside: bool, text: str, size: int) -> tuple[str, str]:
    splitter = ReasoningSplitter(starts_inside)
    reasoning, content = [], []
    for i in range(0, len(text), size):
        piece = splitter.feed(text[i:i + size])
        reasoning.append(piece.reasoning)
        content.append(piece.content)
    tail = splitter.flush()
    return "".join(reasoning) + tail.reasoning, "".join(content) + tail.content


@pytest.mark.parametrize("starts_inside, text, reasoning, content", CASES)
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_split_is_the_same_for_every_piece_size(starts_inside, text, reasoning, content, size) -> None:
    assert _run(starts_inside, text, size) == (reasoning, content)


def test_reasoning_streams_before_the_block_ends() -> None:
    splitter = ReasoningSplitter()
    assert splitter.feed("<think>first ").reasoning == "first "
    piece = splitter.feed("second</th")
    assert piece.reasoning == "second" and piece.content == ""  # "</th" may close the block
    piece = splitter.feed("ink>\n\nanswer")
    assert piece.reasoning == "" and piece.content == "answer"


def test_detection_and_the_prompts_open_block() -> None:
    qwen3_like = "{%- if enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    assert detect_reasoning("auto", qwen3_like) and not detect_reasoning("auto", "{{ content }}")
    assert detect_reasoning("think", "{{ content }}") and not detect_reasoning("none", qwen3_like)
    assert opens_inside_block("<|im_start|>assistant\n<think>\n")
    assert not opens_inside_block("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_inside_block("<|im_start|>assistant\n")
