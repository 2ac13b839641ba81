"""Families that write a call's arguments as tagged text, one tag pair per argument:

- `glm45` (GLM-4.5, GLM-4.6): `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>
  \\n...</tool_call>`, one block per call.
- `minimax_m2` (MiniMax-M2): `<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="KEY">VALUE
  </parameter>\\n...</invoke>\\n...</minimax:tool_call>`, several calls in one block.
- `qwen3_coder` (Qwen3-Coder): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>
  \\n...</function>\\n</tool_call>`, one block per call; the newline after `<parameter=KEY>` and the
  one before `</parameter>` belong to the layout, not to the value.

A value is read as its tool's schema says it is written (`tagged_arguments`: a plain string
parameter's value is the text itself, any other's a JSON text), the same reading the tool grammar
writes it by. A value of a parameter the schema does not name (an open object, or a parser
without the request's tools) is text, as the templates write a string argument, unless it reads as
another JSON value (a number, true/false, null, an object, an array: what the templates write as
JSON). A call is reported whole once its tags close, not piece by piece (`partial_calls`): its
arguments are JSON only once every value is read.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence

from gateway_service.tagged_arguments import ToolArguments, UnsupportedArguments, arguments_by_tool
from gateway_service.tool_call_stream import NAME, PartialCall
from gateway_service.tool_parser_base import BlockParser, ParsedCall, ToolCallParser, read_sequence
from radixserve.v1 import generation_pb2


def text_value(text: str) -> object:
    """An argument written as text: the JSON value it spells, unless that is a string (the text
    itself then, quotes and all) or not JSON at all (NaN and Infinity are not)."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except ValueError:
        return text
    return text if isinstance(value, str) else value


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def value_text(value: object) -> str:
    """An argument as the templates write it: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class TaggedBlockParser(BlockParser):
    """A family whose calls are tagged text. No JSON to stream: each call is reported once it is
    closed, from the blocks closed so far and the calls already closed in the open one."""

    # The request's tools, by name, as their values are written (empty: none known).
    _tools: dict[str, ToolArguments] = {}

    def with_tools(self, tools: Sequence[generation_pb2.Tool]) -> ToolCallParser:
        bound = copy.copy(self)
        try:
            bound._tools = arguments_by_tool(tools)
        except UnsupportedArguments:  # refused before any output (chat_format); read as text
            bound._tools = {}
        return bound

    # A call in a block (groups: its name, its arguments' text) and an argument (its key, its value).
    _CALL: re.Pattern
    _PAIR: re.Pattern

    def _read_block(self, body: str) -> list[ParsedCall]:
        return read_sequence(self._CALL, body, self._read_call)

    def _read_open_block(self, body: str) -> list[ParsedCall]:
        """The calls closed so far in a block still being written."""
        return read_sequence(self._CALL, body, self._read_call, whole=False)

    def _read_call(self, match: re.Match) -> ParsedCall:
        name, arguments = match.groups()
        return self._arguments_call(name, read_sequence(
            self._PAIR, arguments, lambda pair: (pair.group(1), self._value_text(pair.group(2)))))

    def _value_text(self, written: str) -> str:
        """A value's text as the layout writes it, less what the layout puts around it."""
        return written

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls: list[ParsedCall] = []
        try:
            for start, end in self._blocks(text):
                body_start = start + len(self.marker)
                if end is None:
                    calls.extend(self._read_open_block(text[body_start:]))
                else:
                    calls.extend(self._read_block(text[body_start:end]))
        except (ValueError, TypeError, KeyError):
            pass  # what is malformed is not streamed; the whole output says what it is at the end
        return [PartialCall(call.name, call.arguments, True) for call in calls]

    def _arguments_call(self, name: str, pairs: list[tuple[str, str]]) -> ParsedCall:
        """A call from its name and its (key, value text) pairs."""
        name = name.strip()
        if not re.fullmatch(NAME, name):
            raise ValueError(f"not a function name: {name!r}")
        tool = self._tools.get(name)
        arguments = {}
        for key, value in pairs:
            if not key.strip():
                raise ValueError("an argument without a name")
            argument = None if tool is None else tool.argument(key.strip())
            arguments[key.strip()] = text_value(value) if argument is None else argument.read(value)
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


class Glm45Parser(TaggedBlockParser):
    name = "glm45"
    marker = "<tool_call>"
    closing = "</tool_call>"
    cue = "<arg_key>"
    inner_tags = (closing, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    # The name, then the pairs (the block is the call, so an open block holds none closed).
    _CALL = re.compile(r"\s*([^<]*)(.*)", re.S)
    _PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def _read_block(self, body: str) -> list[ParsedCall]:
        return [self._read_call(self._CALL.fullmatch(body))]

    def _read_open_block(self, body: str) -> list[ParsedCall]:
        return []

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        return "\n".join(
            f"{self.marker}{name}\n"
            + "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{value_text(value)}</arg_value>\n"
                      for key, value in args.items())
            + self.closing
            for name, args in calls
        )


class MiniMaxM2Parser(TaggedBlockParser):
    name = "minimax_m2"
    marker = "<minimax:tool_call>"
    closing = "</minimax:tool_call>"
    cue = marker
    inner_tags = (closing,)
    _CALL = re.compile(r'\s*<invoke name="([^"]*)">(.*?)</invoke>', re.S)
    _PAIR = re.compile(r'\s*<parameter name="([^"]*)">(.*?)</parameter>', re.S)

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        invokes = "".join(
            f'<invoke name="{name}">\n'
            + "".join(f'<parameter name="{key}">{value_text(value)}</parameter>\n' for key, value in args.items())
            + "</invoke>\n"
            for name, args in calls
        )
        return f"{self.marker}\n{invokes}{self.closing}"


class Qwen3CoderParser(TaggedBlockParser):
    name = "qwen3_coder"
    marker = "<tool_call>"
    closing = "</tool_call>"
    cue = "<function="
    inner_tags = (closing,)
    _CALL = re.compile(r"\s*<function=([^>]*)>(.*?)</function>", re.S)
    _PAIR = re.compile(r"\s*<parameter=([^>]*)>(.*?)</parameter>", re.S)

    def _value_text(self, written: str) -> str:
        return written.removeprefix("\n").removesuffix("\n")

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        return "\n".join(
            f"{self.marker}\n<function={name}>\n"
            + "".join(f"<parameter={key}>\n{value_text(value)}\n</parameter>\n" for key, value in args.items())
            + f"</function>\n{self.closing}"
            for name, args in calls
        )
