"""The grammar that makes a model's tool calls valid: an llguidance Lark grammar, sent as the
request's constraint like any `guided_grammar`.

Each call is a compact JSON object `{"name": <one of the tools>, <arguments key>: <that tool's
parameters schema>}` (llguidance's `%json`), laid out the way the parser family reads it
(`tool_parsers`). Two shapes:

- required (`tool_choice: "required"` or a named function): the output is the calls and
  nothing else, so it always parses and always validates;
- auto: either text that never contains the family's marker, or text up to the marker and then
  calls; so whatever the model writes, a call it starts is valid. (Llama 3's calls have no
  marker before them: there the output is either text that does not open with `{` or calls.)

`parallel` allows more than one call; otherwise exactly one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from gateway_service.tool_parser_base import ToolCallParser
from gateway_service.lark_writer import literal, regex_escape
from gateway_service.tool_grammar_layouts import LAYOUTS, layout_calls
from gateway_service.tool_parsers import HermesParser, Llama3JsonParser, MistralParser
from radixserve.grammar_compiler import JSON_OPTIONS
from radixserve.v1 import generation_pb2

# A tool without a parameters schema takes any object.
ANY_OBJECT = {"type": "object"}


def call_schema(tools: Sequence[generation_pb2.Tool], arguments_key: str) -> dict:
    """The JSON schema of one call of any of `tools` (name first, then the arguments)."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                arguments_key: json.loads(tool.parameters) if tool.parameters else ANY_OBJECT,
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    # The compact layout of every other JSON constraint: a sampled model cannot run away into
    # whitespace, and the calls read as the parsers' own rendering does.
    return {"x-guidance": JSON_OPTIONS, **schema}


def tool_call_grammar(
    parser: ToolCallParser, tools: Sequence[generation_pb2.Tool], required: bool, parallel: bool,
    marker_token: int | None = None, special_tags: Mapping[str, int] | None = None,
) -> str:
    """The Lark grammar for `tools` (already narrowed to the named one, if any).
    `marker_token`: the id of the marker when it is one special token (a model writes it as
    that token, which no text lexeme can produce); `special_tags`: the ids of the family's other
    tags that are (`tool_grammar_layouts`). Raises `UnsupportedArguments` for a tool whose
    schema the family's layout cannot enforce."""
    marker = literal(parser.marker) if marker_token is None else f"<[{marker_token}]>"
    if type(parser) in LAYOUTS:
        special = dict(special_tags or {})
        if marker_token is not None:
            special[parser.marker] = marker_token
        calls = layout_calls(parser, tools, parallel, special)
        return _with_marker(parser.marker, marker, marker_token is not None, calls, required)
    body = f"body: %json {json.dumps(call_schema(tools, parser.arguments_key))}\n"
    if isinstance(parser, HermesParser):
        calls = _repeated('"\\n" body "\\n</tool_call>"', f'"\\n" {marker}', parallel)
        return _with_marker(parser.marker, marker, marker_token is not None, calls, required) + body
    if isinstance(parser, MistralParser):
        calls = f'calls: "[" {_items("body", chr(34) + ", " + chr(34), parallel)} "]"\n'
        return _with_marker(parser.marker, marker, marker_token is not None, calls, required) + body
    if isinstance(parser, Llama3JsonParser):
        calls = f'calls: {_items("body", chr(34) + "; " + chr(34), parallel)}\n'
        if required:
            return "start: calls\n" + calls + body
        # Text that does not open (after blanks) with "{" and never holds the tag; or calls.
        text = _text_without(r"(\s*\{|(?s:.*)<\|python_tag\|>)(?s:.*)")
        return f"start: TEXT | calls\nTEXT: {text}\n" + calls + body
    raise ValueError(f"no grammar for the {parser.name} format")


def _items(item: str, separator: str, parallel: bool) -> str:
    return f"{item} ({separator} {item})*" if parallel else item


def _repeated(call: str, again: str, parallel: bool) -> str:
    """`calls`, right after the marker: one call, or calls each reopened by `again`."""
    return f"calls: {call} ({again} {call})*\n" if parallel else f"calls: {call}\n"


def _with_marker(marker: str, marker_lark: str, special: bool, calls: str, required: bool) -> str:
    if required:
        return f"start: {marker_lark} calls\n" + calls
    # Free text never holds the marker's text (a call it opened would escape the constraint).
    escaped = regex_escape(marker)
    text = _text_without(f"(?s:.*){escaped}(?s:.*)")
    if special:  # the marker token itself ends any text lexeme
        return f"start: TEXT | TEXT {marker_lark} calls | {marker_lark} calls\nTEXT: {text}\n" + calls
    # Or free text up to the marker's first occurrence (one lexeme, so that a token may span
    # its end), then calls.
    opening = f"/(?s:.*){escaped}/ & ~/(?s:.*){escaped}(?s:.+)/"
    return f"start: TEXT | OPENING calls\nTEXT: {text}\nOPENING: {opening}\n" + calls


def _text_without(pattern: str) -> str:
    """A lexeme: any text but one matching `pattern` (llguidance's regex and/not)."""
    return f"/(?s:.*)/ & ~/{pattern}/"
