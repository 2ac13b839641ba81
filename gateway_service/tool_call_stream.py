"""A call's arguments as they are generated: the calls readable so far in a growing output.

The families whose arguments are a JSON object after a header that names the call stream them
as they are written. Each such layout is a header pattern here, its group 1 the name, matching
once the name is complete: `{"name": N, "arguments": {...}}` (`JSON_CALL`: Hermes, Mistral's
array; `"parameters"` for Llama 3), Mistral's `[TOOL_CALLS]N[ARGS]{...}` (`NAMED_ARGS`), a
harmony message `<|start|>…to=functions.N…<|message|>{...}` whose body ends at the next marker
(`HARMONY_CALL`), DeepSeek's `<｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}` or
`<｜tool▁call▁begin｜>function<｜tool▁sep｜>N\n```json\n{...}` (`DEEPSEEK_CALL`), Kimi-K2's
`<|tool_call_begin|>functions.N:0<|tool_call_argument_begin|>{...}` (`KIMI_CALL`).
`partial_calls` finds, with a parser's own headers, each call whose name is complete and the
raw text of its arguments so far, cut where the object closes (a scan that knows JSON strings
and escapes), so the pieces a stream sends concatenate to the arguments' own text. A call laid
out otherwise (arguments as a JSON string, name after the arguments) is not found here: the
splitter then reports it whole when the output ends, as without streaming.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from gateway_service import harmony

# A function's name where a layout writes it bare (not as a JSON string). Each header's name is
# its last group that matched.
NAME = r"[A-Za-z0-9_.-]+"
JSON_CALL = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
NAMED_ARGS = re.compile(rf"\[TOOL_CALLS\]\s*({NAME})\[ARGS\]\s*")
HARMONY_CALL = re.compile(harmony.MESSAGE_HEADER, re.S)
# DeepSeek's markers: full-width bars (U+FF5C) and U+2581 between words, as its tokenizer spells them.
DEEPSEEK_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DEEPSEEK_SEP = "<｜tool▁sep｜>"
DEEPSEEK_CALL_END = "<｜tool▁call▁end｜>"
# V3/R1: `function<sep>NAME` then a fenced json block; V3.1: `NAME<sep>` then the object itself (a
# name is complete there only once the object opens: "function<sep>" may still be V3's type).
DEEPSEEK_CALL = re.compile(rf"{DEEPSEEK_CALL_BEGIN}\s*(?:function\s*{DEEPSEEK_SEP}\s*({NAME})\s*```json\s*"
                           rf"|({NAME})\s*{DEEPSEEK_SEP}\s*(?=\{{))")
KIMI_CALL_BEGIN, KIMI_ARGUMENTS = "<|tool_call_begin|>", "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
# `functions.NAME:INDEX`; the prefix and the index are optional.
KIMI_CALL = re.compile(rf"{re.escape(KIMI_CALL_BEGIN)}\s*(?:functions\.)?({NAME})(?::\d+)?\s*"
                       rf"{re.escape(KIMI_ARGUMENTS)}\s*")


@dataclass(frozen=True, slots=True)
class PartialCall:
    name: str
    arguments: str  # the arguments' raw text so far (the whole object once `complete`)
    complete: bool


def partial_calls(text: str, headers: Sequence[re.Pattern]) -> list[PartialCall]:
    """The calls in `text` (an output from its calls' marker on) written under one of `headers`
    whose name is complete, in order; only the last may be incomplete."""
    calls: list[PartialCall] = []
    position = 0
    while True:
        found = _next_call(text, position, headers)
        if found is None:
            return calls
        name, start, limit = found
        if start < limit and text[start] != "{":
            return calls  # not an object: reported whole at the end
        end = object_end(text[:limit], start)
        if end is None:
            calls.append(PartialCall(name, text[start:limit], False))
            return calls
        calls.append(PartialCall(name, text[start:end], True))
        position = end


def _next_call(text: str, position: int, headers: Sequence[re.Pattern]) -> tuple[str, int, int] | None:
    """The earliest call from `position` on: its name, where its arguments start, and how far
    they may reach (a harmony body: to its end marker; else the whole text)."""
    matches = [m for m in (header.search(text, position) for header in headers) if m]
    if not matches:
        return None
    match = min(matches, key=lambda m: m.start())
    name = match.group(match.lastindex)
    if match.re is HARMONY_CALL:
        name = harmony.read_header(name).function
        if name is None:
            return None  # not a call: the parser says what it is at the end
        return name, match.end(), harmony.body_end(text, match.end())
    if match.re is JSON_CALL:
        try:
            name = json.loads(f'"{name}"')
        except ValueError:
            return None
    return name, match.end(), len(text)


def object_end(text: str, start: int) -> int | None:
    """The index just past the JSON object opening at `text[start]`; None while it is open."""
    depth = 0
    in_string = escaped = False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None
