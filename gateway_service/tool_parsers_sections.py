"""Families that write their calls in one section framed by special tokens, each call a name
and a JSON object of arguments (which stream as they are written, see `tool_call_stream`):

- `deepseek_v3` (DeepSeek-V3, R1) and `deepseek_v31` (DeepSeek-V3.1): `<｜tool▁calls▁begin｜>`, then
  per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`
  (V3, R1) or `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` (V3.1), then
  `<｜tool▁calls▁end｜>`. Both read either layout; each renders its own.
- `kimi_k2` (Kimi-K2): `<|tool_calls_section_begin|>`, then per call
  `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>`,
  then `<|tool_calls_section_end|>`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from gateway_service.tool_call_stream import (
    DEEPSEEK_CALL,
    DEEPSEEK_CALL_BEGIN,
    DEEPSEEK_CALL_END,
    DEEPSEEK_SEP,
    KIMI_ARGUMENTS,
    KIMI_CALL,
    KIMI_CALL_BEGIN,
    KIMI_CALL_END,
    NAME,
)
from gateway_service.tool_parser_base import BlockParser, ParsedCall, read_sequence


class DeepSeekV3Parser(BlockParser):
    name = "deepseek_v3"
    marker = "<｜tool▁calls▁begin｜>"
    closing = "<｜tool▁calls▁end｜>"
    inner_tags = (closing, DEEPSEEK_CALL_BEGIN, DEEPSEEK_SEP, DEEPSEEK_CALL_END)
    call_headers = (DEEPSEEK_CALL,)
    # What V3's template writes around the arguments (V3.1's does not), and between two calls.
    FENCE = "```json"
    call_separator = "\n"
    _CALL = re.compile(rf"\s*{DEEPSEEK_CALL_BEGIN}(.*?){DEEPSEEK_CALL_END}", re.S)
    _FENCED = re.compile(rf"\s*({NAME})\s*```json\s*(.*?)\s*```\s*", re.S)

    def _read_block(self, body: str) -> list[ParsedCall]:
        return read_sequence(self._CALL, body, self._read_call)

    def _read_call(self, match: re.Match) -> ParsedCall:
        head, sep, rest = match.group(1).partition(DEEPSEEK_SEP)
        if not sep:
            raise ValueError("a call without its separator")
        if rest.lstrip().startswith("{"):  # V3.1: the name, then the object
            name, arguments = head.strip(), rest
        else:  # V3: the type, then the name and the fenced object
            fenced = self._FENCED.fullmatch(rest)
            if head.strip() != "function" or fenced is None:
                raise ValueError("neither of DeepSeek's call layouts")
            name, arguments = fenced.groups()
        if not re.fullmatch(NAME, name):
            raise ValueError(f"not a function name: {name!r}")
        return self._call({"name": name, "arguments": json.loads(arguments)})

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        return self._section(
            f"{DEEPSEEK_CALL_BEGIN}function{DEEPSEEK_SEP}{name}\n{self.FENCE}\n{json.dumps(args)}\n```"
            f"{DEEPSEEK_CALL_END}"
            for name, args in calls
        )

    def _section(self, calls: Iterable[str]) -> str:
        return f"{self.marker}{self.call_separator.join(calls)}{self.closing}"


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseek_v31"
    call_separator = ""

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        return self._section(
            f"{DEEPSEEK_CALL_BEGIN}{name}{DEEPSEEK_SEP}{json.dumps(args)}{DEEPSEEK_CALL_END}" for name, args in calls
        )


class KimiK2Parser(BlockParser):
    name = "kimi_k2"
    marker = "<|tool_calls_section_begin|>"
    closing = "<|tool_calls_section_end|>"
    cue = marker
    inner_tags = (closing, KIMI_CALL_BEGIN, KIMI_ARGUMENTS, KIMI_CALL_END)
    call_headers = (KIMI_CALL,)
    _CALL = re.compile(rf"\s*{KIMI_CALL.pattern}(.*?){re.escape(KIMI_CALL_END)}", re.S)

    def _read_block(self, body: str) -> list[ParsedCall]:
        return read_sequence(self._CALL, body, lambda match: self._call(
            {"name": match.group(1), "arguments": json.loads(match.group(2))}))

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        return self.marker + "".join(
            f"{KIMI_CALL_BEGIN}functions.{name}:{index}{KIMI_ARGUMENTS}{json.dumps(args)}{KIMI_CALL_END}"
            for index, (name, args) in enumerate(calls)
        ) + self.closing
