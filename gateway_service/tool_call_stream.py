"""A call's arguments as they are generated: the calls readable so far in a growing output.

Every family writes a call as a name and then a JSON object of arguments: `{"name": N,
"arguments": {...}}` (Hermes, Mistral's array; `"parameters"` for Llama 3) or Mistral's
`[TOOL_CALLS]N[ARGS]{...}`, or a harmony message `<|start|>…to=functions.N…<|message|>{...}`
whose body ends at the next marker. `partial_calls` finds each call whose name is complete and
the raw text of its arguments so far, cut where the object closes (a scan that knows JSON
strings and escapes), so the pieces a stream sends concatenate to the arguments' own text. A
call laid out otherwise (arguments as a JSON string, name after the arguments) is not found
here: the splitter then reports it whole when the output ends, as without streaming.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from gateway_service import harmony

_JSON_CALL = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_NAMED_ARGS = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.-]+)\[ARGS\]\s*")
_HARMONY_CALL = re.compile(harmony.MESSAGE_HEADER, re.S)


@dataclass(frozen=True, slots=True)
class PartialCall:
    name: str
    arguments: str  # the arguments' raw text so far (the whole object once `complete`)
    complete: bool


def partial_calls(text: str) -> list[PartialCall]:
    """The calls in `text` (an output from its calls' marker on) whose name is complete, in
    order; only the last may be incomplete."""
    calls: list[PartialCall] = []
    position = 0
    while True:
        found = _next_call(text, position)
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


def _next_call(text: str, position: int) -> tuple[str, int, int] | None:
    """The earliest call from `position` on: its name, where its arguments start, and how far
    they may reach (a harmony body: to its end marker; else the whole text)."""
    layouts = (_JSON_CALL, _NAMED_ARGS, _HARMONY_CALL)
    matches = [m for m in (layout.search(text, position) for layout in layouts) if m]
    if not matches:
        return None
    match = min(matches, key=lambda m: m.start())
    name = match.group(1)
    if match.re is _HARMONY_CALL:
        name = harmony.read_header(name).function
        if name is None:
            return None  # not a call: the parser says what it is at the end
        return name, match.end(), harmony.body_end(text, match.end())
    if match.re is _JSON_CALL:
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
