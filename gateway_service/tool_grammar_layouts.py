"""The tool-call grammars of the families that do not write a call as one JSON object (`tool_grammar`
has those): the tagged layouts (GLM-4.5, MiniMax-M2, Qwen3-Coder: one tag pair per argument, see
`tagged_arguments` for how each value is written) and the sections framed by markers (DeepSeek V3
and V3.1, Kimi-K2: a name and a JSON object of arguments). Each grammar writes exactly the layout
its parser reads (`tool_parsers_tagged`, `tool_parsers_sections`), as the family's template does.

A tag that is one special token in the tokenizer is written as that token (`<[id]>`: the model
writes it so, and no text lexeme can produce it); any other as its text. A raw text value never
holds a closing tag of its layout (the parser would end the value, the call or the block there),
spelled out or otherwise: the value and the text part of what closes it are one lexeme, up to the
first closing tag, so that a token may span the value's end.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gateway_service.lark_writer import Lark, literal
from gateway_service.tagged_arguments import Argument, ToolArguments, arguments_by_tool
from gateway_service.tool_call_stream import (
    DEEPSEEK_CALL_BEGIN,
    DEEPSEEK_CALL_END,
    DEEPSEEK_SEP,
    KIMI_ARGUMENTS,
    KIMI_CALL_BEGIN,
    KIMI_CALL_END,
)
from gateway_service.tool_parser_base import ToolCallParser
from gateway_service.tool_parsers_sections import DeepSeekV3Parser, DeepSeekV31Parser, KimiK2Parser
from gateway_service.tool_parsers_tagged import Glm45Parser, MiniMaxM2Parser, Qwen3CoderParser
from radixserve.v1 import generation_pb2

# An argument's name where the schema gives none (an open object): what the parsers read as one.
OPEN_KEY = r"[A-Za-z0-9_.$-]+"


def layout_calls(parser: ToolCallParser, tools: Sequence[generation_pb2.Tool], parallel: bool,
                 special: Mapping[str, int]) -> str:
    """The Lark rules of `calls` (what follows the family's marker: the calls and whatever closes
    them) for `tools`; raises `UnsupportedArguments` for a schema a tagged layout cannot enforce."""
    lark = Lark(special)
    family = type(parser)
    if family in _TAGGED:
        by_tool = arguments_by_tool(tools)
        calls = _tagged(lark, parser, [by_tool[tool.name] for tool in tools], parallel)
    else:
        calls = _SECTIONS[family](lark, parser, tools, parallel)
    return f"calls: {calls}\n" + lark.text()


def _alternatives(items: Sequence[str]) -> str:
    return "(" + " | ".join(items) + ")"


def _repeated(item: str, separator: str, parallel: bool) -> str:
    return f"{item} ({separator} {item})*" if parallel else item


@dataclass(frozen=True, slots=True)
class TaggedLayout:
    """How a tagged family writes one call: `head` (with the name) and `tail` around its
    arguments; each argument as `key_open` KEY `key_close` `between` VALUE `value_close` `after`
    (pieces: tags, or text); `excluded`: the closing tags no raw value may hold."""

    head: str
    tail: tuple[str, ...]
    key_open: tuple[str, ...]
    key_close: tuple[str, ...]
    between: tuple[str, ...]
    value_close: tuple[str, ...]
    after: str
    excluded: tuple[str, ...]


def _tagged_call(lark: Lark, layout: TaggedLayout, tool: ToolArguments) -> str:
    """One call of `tool`: its properties in order (the optional ones may be left out), or any
    keys for an open object."""
    def pieces(items: Sequence[str]) -> str:
        return " ".join(lark.tag(piece) for piece in items)

    def pair(key: str, argument: Argument | None) -> str:
        value = _value(lark, argument, layout.value_close, layout.excluded)
        return lark.rule(f"{pieces(layout.key_open)} {key} {pieces(layout.between)} {value} {literal(layout.after)}")

    if tool.open:
        arguments = pair(lark.text_then(layout.key_close, layout.excluded, pattern=OPEN_KEY), None) + "*"
    else:
        arguments = " ".join(
            pair(f"{literal(argument.name)} {pieces(layout.key_close)}", argument) + ("" if argument.required else "?")
            for argument in tool.arguments)
    return lark.rule(f"{literal(layout.head.format(name=tool.name))} {arguments} {pieces(layout.tail)}")


def _value(lark: Lark, argument: Argument | None, close: Sequence[str], excluded: Sequence[str]) -> str:
    """An argument's value then what closes it."""
    closing = " ".join(lark.tag(piece) for piece in close)
    if argument is not None and not argument.raw:
        return f"{lark.json_value(argument.schema)} {closing}"
    if argument is not None and argument.choices is not None and not any(
            tag in choice for choice in argument.choices for tag in excluded):
        return f"{_alternatives([literal(choice) for choice in argument.choices])} {closing}"
    if argument is None:
        return lark.text_then(close, excluded)
    return lark.text_then(close, excluded, argument.min_length, argument.max_length)


def _tagged(lark: Lark, parser: ToolCallParser, tools: Sequence[ToolArguments], parallel: bool) -> str:
    """GLM-4.5's and Qwen3-Coder's blocks of one call each, separated by a line break;
    MiniMax-M2's one block of calls."""
    layout = _TAGGED[type(parser)]
    calls = _alternatives([_tagged_call(lark, layout, tool) for tool in tools])
    if isinstance(parser, MiniMaxM2Parser):
        return f'"\\n" {calls}{"+" if parallel else ""} {lark.tag(parser.closing)}'
    return _repeated(calls, f'"\\n" {lark.tag(parser.marker)}', parallel)


def _deepseek(lark: Lark, parser: DeepSeekV3Parser, tools: Sequence[generation_pb2.Tool], parallel: bool) -> str:
    """V3 and R1, calls separated by a line break:
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`;
    V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`; the section closed by
    `<｜tool▁calls▁end｜>`."""
    begin, sep, end = (lark.tag(tag) for tag in (DEEPSEEK_CALL_BEGIN, DEEPSEEK_SEP, DEEPSEEK_CALL_END))
    fenced = not isinstance(parser, DeepSeekV31Parser)
    calls = []
    for tool in tools:
        arguments = lark.json_value(_schema(tool))
        if fenced:
            calls.append(lark.rule(f'{begin} "function" {sep} {literal(tool.name)} "\\n```json\\n" {arguments} '
                                   f'"\\n```" {end}'))
        else:
            calls.append(lark.rule(f"{begin} {literal(tool.name)} {sep} {arguments} {end}"))
    separator = '"\\n"' if fenced else ""
    return f"{_repeated(_alternatives(calls), separator, parallel)} {lark.tag(parser.closing)}"


def _kimi_k2(lark: Lark, parser: KimiK2Parser, tools: Sequence[generation_pb2.Tool], parallel: bool) -> str:
    """`<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>`
    per call, the section closed by `<|tool_calls_section_end|>`."""
    index = lark.rule("/[0-9]{1,4}/")  # the call's place in the section, 0 on
    calls = _alternatives([
        lark.rule(f"{lark.tag(KIMI_CALL_BEGIN)} {literal('functions.' + tool.name + ':')} {index} "
                  f"{lark.tag(KIMI_ARGUMENTS)} {lark.json_value(_schema(tool))} {lark.tag(KIMI_CALL_END)}")
        for tool in tools])
    return f"{calls}{'+' if parallel else ''} {lark.tag(parser.closing)}"


def _schema(tool: generation_pb2.Tool) -> dict:
    return json.loads(tool.parameters) if tool.parameters else {"type": "object"}


_TAGGED = {
    # <tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>
    Glm45Parser: TaggedLayout("{name}\n", (Glm45Parser.closing,), ("<arg_key>",), ("</arg_key>",),
                              ("\n", "<arg_value>"), ("</arg_value>",), "\n",
                              ("</arg_key>", "</arg_value>", Glm45Parser.closing)),
    # <tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n...</function>\n</tool_call>
    Qwen3CoderParser: TaggedLayout("\n<function={name}>\n", ("</function>\n", Qwen3CoderParser.closing),
                                   ("<parameter=",), (">",), ("\n",), ("\n", "</parameter>"), "\n",
                                   ("</parameter>", "</function>", Qwen3CoderParser.closing)),
    # <minimax:tool_call>\n<invoke name="NAME">\n<parameter name="K">V</parameter>\n...</invoke>\n...
    MiniMaxM2Parser: TaggedLayout('<invoke name="{name}">\n', ("</invoke>\n",), ('<parameter name="',), ('">',),
                                  (), ("</parameter>",), "\n",
                                  ("</parameter>", "</invoke>", MiniMaxM2Parser.closing)),
}
_SECTIONS = {DeepSeekV3Parser: _deepseek, DeepSeekV31Parser: _deepseek, KimiK2Parser: _kimi_k2}
LAYOUTS = frozenset({*_TAGGED, *_SECTIONS})
