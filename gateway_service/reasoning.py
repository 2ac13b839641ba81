"""Reasoning output: a thinking model's `<think>…</think>` block split from its answer, as text
streams in.

Only a block at the very start of the output counts (blank lines before it are allowed); when
the rendered prompt already ends inside an open block (templates that open `<think>` in the
generation prompt), the output starts as reasoning. After `</think>` the answer follows, without
its leading newlines. An output that ends inside the block (max_tokens) is all reasoning: what
was streamed as reasoning stays reasoning. The tags themselves are in neither part.

`--reasoning-parser` picks the format (`auto`: `harmony` when the chat template writes harmony,
gpt-oss's format, whose splitter is `harmony_splitter`; else `think` when it mentions `<think>`
or only `</think>`, as DeepSeek-R1's first template, which cuts the reasoning out of history
turns, and whose model opens the block itself; else none); a request turns the `<think>` split
off with `chat_template_kwargs.enable_thinking: false` (harmony's cannot be: its markers would be
content). Templates that end the generation prompt inside the block (MiniMax-M2's, and
DeepSeek-V3.1's in thinking mode) start the output as reasoning; one that ends it with a closed
or empty block (DeepSeek-V3.1's by default, GLM-4.5's without thinking) does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway_service import harmony
from gateway_service.text_markers import partial_suffix

OPEN, CLOSE = "<think>", "</think>"
AUTO, THINK, NONE, HARMONY = "auto", "think", "none", harmony.HARMONY
REASONING_PARSERS = (AUTO, THINK, HARMONY, NONE)


def detect_reasoning(name: str, chat_template: str) -> str | None:
    """How outputs are split (`think` or `harmony`; None: not), for a `--reasoning-parser`
    value and the model's template."""
    if name == AUTO:
        if harmony.in_template(chat_template):
            return HARMONY
        return THINK if OPEN in chat_template or CLOSE in chat_template else None
    return None if name == NONE else name


def opens_inside_block(prompt_tail: str) -> bool:
    """Whether a rendered prompt ends inside an open `<think>` block."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


@dataclass(slots=True)
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Feed text pieces with `feed`, then `flush` once; each returns what became final."""

    _START, _REASONING, _ANSWER_START, _ANSWER = range(4)

    def __init__(self, starts_inside: bool = False) -> None:
        self._state = self._REASONING if starts_inside else self._START
        self._pending = ""

    def feed(self, text: str) -> Split:
        self._pending += text
        out = Split()
        while True:
            state, pending = self._state, self._pending
            if state == self._START:
                stripped = pending.lstrip()
                if stripped.startswith(OPEN):
                    self._state, self._pending = self._REASONING, stripped[len(OPEN):]
                elif OPEN.startswith(stripped):
                    return out  # blank, or part of the tag: wait
                else:
                    self._state = self._ANSWER
            elif state == self._REASONING:
                index = pending.find(CLOSE)
                if index >= 0:
                    out.reasoning += pending[:index]
                    self._state, self._pending = self._ANSWER_START, pending[index + len(CLOSE):]
                    continue
                keep = partial_suffix(pending, CLOSE)
                out.reasoning += pending[:len(pending) - keep]
                self._pending = pending[len(pending) - keep:]
                return out
            elif state == self._ANSWER_START:
                stripped = pending.lstrip("\n")
                if not stripped:
                    self._pending = ""
                    return out
                self._state, self._pending = self._ANSWER, stripped
            else:
                out.content += pending
                self._pending = ""
                return out

    def flush(self) -> Split:
        pending, self._pending = self._pending, ""
        if self._state == self._REASONING:
            return Split(reasoning=pending)
        return Split(content=pending)
