"""Tool-call formats: how a model family writes its calls, read back into (name, arguments).

One parser per family, chosen once per gateway (`--tool-call-parser`, default detected from the
chat template by `detect_tool_parser`); what a parser promises is in `tool_parser_base`:

- `hermes` (Hermes, Qwen 2.5/3, and the fallback for templates that cannot render tools):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call.
- `llama3_json` (Llama 3.1+): the output is the call itself, `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`), several separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`, or the
  newer `[TOOL_CALLS]name[ARGS]{...}` per call.
- `harmony` (gpt-oss): a message to `functions.NAME` whose body is the arguments object
  (`harmony`); it reads the content that `harmony_splitter` passes on, where each call is one
  such message and nothing else is markup.
- `glm45`, `minimax_m2`, `qwen3_coder`: arguments as tagged text (`tool_parsers_tagged`).
- `deepseek_v3`, `deepseek_v31`, `kimi_k2`: sections of calls framed by special tokens, each a
  name and a JSON object (`tool_parsers_sections`).

All but harmony are constrained by `tool_grammar` (and `tool_grammar_layouts`); harmony's calls
are parsed, not constrained (`constrained`), and a `tool_choice` that only a grammar could enforce
is refused (`chat_format`).
"""

from __future__ import annotations

import json
import re

from gateway_service import harmony
from gateway_service.text_markers import partial_suffix
from gateway_service.tool_call_stream import HARMONY_CALL, JSON_CALL, NAMED_ARGS
from gateway_service.tool_parser_base import ParsedCall, ToolCallParser
from gateway_service.tool_parsers_sections import DeepSeekV3Parser, DeepSeekV31Parser, KimiK2Parser
from gateway_service.tool_parsers_tagged import Glm45Parser, MiniMaxM2Parser, Qwen3CoderParser


class HermesParser(ToolCallParser):
    name = "hermes"
    marker = "<tool_call>"
    closing = "</tool_call>"
    call_headers = (JSON_CALL,)
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)

    def _parse_calls(self, text: str) -> tuple[list[ParsedCall], str]:
        calls, rest, end = [], [], 0
        for match in self._BLOCK.finditer(text):
            rest.append(text[end:match.start()])
            body = match.group(1)
            if match.end() == len(text) and not text.endswith(self.closing):
                # The last block, unclosed: a closing tag cut short (max_tokens) ends it too.
                body = body[:len(body) - partial_suffix(body, self.closing)]
            calls.append(self._call(json.loads(body)))
            end = match.end()
        rest.append(text[end:])
        between = "".join(rest)
        return calls, "" if not between.strip() else between

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        return "\n".join(
            f"{self.marker}\n{json.dumps({'name': name, 'arguments': args})}\n{self.closing}"
            for name, args in calls
        )


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    marker = "<|python_tag|>"
    arguments_key = "parameters"
    call_headers = (JSON_CALL,)

    def call_start(self, text: str) -> int | None:
        index = text.find(self.marker)
        if index >= 0:
            return index
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else None

    def held_back(self, text: str) -> int:
        # Only the start of the output can open a call: hold it while it is blank or a
        # prefix of the tag.
        stripped = text.lstrip()
        if not stripped or self.marker.startswith(stripped):
            return len(text)
        return super().held_back(text)

    def _parse_calls(self, text: str) -> tuple[list[ParsedCall], str]:
        text = text.removeprefix(self.marker).strip()
        decoder = json.JSONDecoder()
        calls, position = [], 0
        while position < len(text):
            item, position = decoder.raw_decode(text, position)
            calls.append(self._call(item, "parameters" if "parameters" in item else "arguments"))
            position = len(text) - len(text[position:].lstrip().removeprefix(";").lstrip())
        return calls, ""

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        return "; ".join(json.dumps({"name": name, "parameters": args}) for name, args in calls)


class MistralParser(ToolCallParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    call_headers = (JSON_CALL, NAMED_ARGS)
    _ARGS = "[ARGS]"

    def _parse_calls(self, text: str) -> tuple[list[ParsedCall], str]:
        body = text.removeprefix(self.marker).strip()
        if body.startswith("["):
            items, end = json.JSONDecoder().raw_decode(body)
            if not isinstance(items, list):
                raise ValueError("calls must be a JSON array")
            return [self._call(item) for item in items], body[end:].strip()
        # The newer layout: name[ARGS]{...}, each call after its own marker.
        calls = []
        for piece in text.split(self.marker)[1:]:
            name, _, arguments = piece.partition(self._ARGS)
            if not _:
                raise ValueError("no [ARGS]")
            calls.append(self._call({"name": name.strip(), "arguments": json.loads(arguments)}))
        return calls, ""

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        return self.marker + json.dumps([{"name": name, "arguments": args} for name, args in calls])


class HarmonyParser(ToolCallParser):
    name = harmony.HARMONY
    marker = harmony.START
    constrained = False
    call_headers = (HARMONY_CALL,)
    # A message: its header, its body, and what ends it (a marker, or the end of the text).
    _MESSAGE = re.compile(harmony.MESSAGE_HEADER + r"(.*?)(?:<\|call\|>|<\|end\|>|<\|return\|>|(?=<\|start\|>)|\Z)",
                          re.S)

    def _parse_calls(self, text: str) -> tuple[list[ParsedCall], str]:
        calls, rest, end = [], [], 0
        for match in self._MESSAGE.finditer(text):
            rest.append(text[end:match.start()])
            name = harmony.read_header(match.group(1)).function
            if name is None:
                raise ValueError("a message that is not a call")
            calls.append(self._call({"name": name, "arguments": json.loads(match.group(2))}))
            end = match.end()
        rest.append(text[end:])
        between = "".join(rest)
        if harmony.MARKER.search(between):
            raise ValueError("markup outside the calls")
        return calls, between

    def unparsed_content(self, text: str) -> str:
        """The calls' bodies as the model wrote them, without their headers and markers."""
        return harmony.MARKER.sub("", self._MESSAGE.sub(lambda match: match.group(2), text))

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        return "".join(f"{harmony.call_header(name)}{json.dumps(args)}{harmony.CALL}" for name, args in calls)


PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser for parser in (
        HermesParser, Llama3JsonParser, MistralParser, HarmonyParser, Glm45Parser, MiniMaxM2Parser, Qwen3CoderParser,
        DeepSeekV3Parser, DeepSeekV31Parser, KimiK2Parser,
    )
}
AUTO = "auto"
TOOL_CALL_PARSERS = (AUTO, *PARSERS)
# Families told apart by a tag their template writes, before the layouts they share a marker with
# (GLM-4.5's and Qwen3-Coder's `<tool_call>` is Hermes' too).
_BY_CUE: tuple[type[ToolCallParser], ...] = (MiniMaxM2Parser, KimiK2Parser, Glm45Parser, Qwen3CoderParser)


def detect_tool_parser(chat_template: str) -> ToolCallParser:
    """The family whose call layout the template shows; Hermes when it shows none (the layout
    the gateway renders itself for templates without tools, see `chat_render`)."""
    if harmony.in_template(chat_template):
        return HarmonyParser()
    if DeepSeekV3Parser.marker in chat_template:
        # V3 and R1 fence the arguments as a json block; V3.1 writes them bare.
        return DeepSeekV3Parser() if DeepSeekV3Parser.FENCE in chat_template else DeepSeekV31Parser()
    for family in _BY_CUE:
        if family.cue in chat_template:
            return family()
    if MistralParser.marker in chat_template:
        return MistralParser()
    if Llama3JsonParser.marker in chat_template or "ipython" in chat_template:
        return Llama3JsonParser()
    return HermesParser()


def tool_parser(name: str, chat_template: str) -> ToolCallParser:
    """The parser a `--tool-call-parser` value names (`auto`: detected from the template)."""
    return detect_tool_parser(chat_template) if name == AUTO else PARSERS[name]()
