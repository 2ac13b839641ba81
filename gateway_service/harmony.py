"""Harmony, the output format of OpenAI's gpt-oss models: messages framed by special tokens.

An output is a run of messages, each a header and a body:

    <|channel|>analysis<|message|>…chain of thought…<|end|>
    <|start|>assistant<|channel|>final<|message|>…answer…<|return|>

The generation prompt already ends with `<|start|>assistant`, so an output starts at its first
header. A header names the channel after `<|channel|>` (`analysis`: chain of thought;
`commentary`: tool calls, and preambles meant for the user; `final`: the answer), may name a
recipient `to=NAME` (before or after the channel: `to=functions.get_weather` is a call of the
caller's function `get_weather`, whose body is its JSON arguments) and a content type (`json`,
or `<|constrain|>json`). A body ends at `<|end|>`, or the turn ends at `<|return|>` (after the
answer) or `<|call|>` (after a call); those two are the model's end-of-turn tokens, left out of
output text like any end of sequence, so the end of an output ends its last message too.

This module holds the markers and reads a header; `harmony_splitter` routes a streamed output's
messages, `tool_parsers.HarmonyParser` reads the calls back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway_service.text_markers import partial_suffix

HARMONY = "harmony"
START, CHANNEL, CONSTRAIN, MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MARKERS = (START, CHANNEL, CONSTRAIN, MESSAGE, END, RETURN, CALL)
# The markers output text keeps (special tokens the parsers read); the two end-of-turn tokens go
# as any end of sequence does.
KEPT_MARKERS = (START, CHANNEL, CONSTRAIN, MESSAGE, END)
MARKER = re.compile("|".join(re.escape(marker) for marker in MARKERS))
# What ends a header: its body's start, or (a frame that opened no body) a new message or an end.
HEADER_STOP = re.compile("|".join(re.escape(marker) for marker in (MESSAGE, START, END, RETURN, CALL)))
# A message from its `<|start|>` to its `<|message|>`, the header between them its group 1 (what
# the call parsers look for: `tool_call_stream`, `tool_parsers.HarmonyParser`).
MESSAGE_HEADER = r"<\|start\|>((?:(?!<\|start\|>|<\|message\|>).)*)<\|message\|>"
ANALYSIS = "analysis"
FUNCTIONS = "functions."


def in_template(chat_template: str) -> bool:
    """Whether a chat template writes harmony (gpt-oss's does: it names channels)."""
    return CHANNEL in chat_template


@dataclass(frozen=True, slots=True)
class Header:
    channel: str | None
    recipient: str | None

    @property
    def function(self) -> str | None:
        """The caller's function a message calls (`to=functions.NAME`); None: not a call."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS):]


def read_header(text: str) -> Header:
    """A message header: the text between its `<|start|>` (or the output's start) and its
    `<|message|>`, as `assistant to=functions.f<|channel|>commentary json` or
    `<|channel|>commentary to=functions.f <|constrain|>json`."""
    words = MARKER.sub(" ", text).split()
    recipient = next((word[len("to="):] for word in words if word.startswith("to=")), None)
    _, found, after = text.partition(CHANNEL)
    channel = re.match(r"[^\s<]*", after).group() if found else ""
    return Header(channel or None, recipient or None)


def call_header(name: str) -> str:
    """The header of a call to the caller's function `name`, as gpt-oss writes it (with the
    `<|start|>assistant` that the prompt holds for a first message)."""
    return f"{START}assistant{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"


def held_marker(text: str) -> int:
    """How many trailing characters of `text` could still become a marker."""
    return max(partial_suffix(text, marker) for marker in MARKERS)


def body_end(text: str, start: int) -> int:
    """Where a body that starts at `start` ends, as far as `text` tells: at the next marker,
    else before a trailing piece that could still become one."""
    found = MARKER.search(text, start)
    if found is not None:
        return found.start()
    return max(start, len(text) - held_marker(text))
