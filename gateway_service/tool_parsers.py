"""Tool-call formats: how a model family writes its calls, read back into (name, arguments).

One parser per family, chosen once per gateway (`--tool-call-parser`, default detected from the
chat template by `detect_tool_parser`):

- `hermes` (Hermes, Qwen 2.5/3, and the fallback for templates that cannot render tools):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call.
- `llama3_json` (Llama 3.1+): the output is the call itself, `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`), several separated by `;`.
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`, or the
  newer `[TOOL_CALLS]name[ARGS]{...}` per call.
- `harmony` (gpt-oss): a message to `functions.NAME` whose body is the arguments object
  (`harmony`); it reads the content that `harmony_splitter` passes on, where each call is one
  such message and nothing else is markup.

Contract of `parse`: it never raises. Either every call in the text is well formed (a name and a
JSON object of arguments), and the calls come back with the rest of the text as content, or the
text comes back whole as content with no calls (`unparsed_content`: the text itself, harmony's
without its markers): a half-parsed output is never half-reported. The grammar side
(`tool_grammar`) emits exactly the layout each parser reads, where the family has a grammar
(`constrained`).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

from gateway_service import harmony
from gateway_service.text_markers import partial_suffix


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, compact text


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str
    calls: tuple[ParsedCall, ...] = ()


class ToolCallParser(ABC):
    """A family's call layout. `marker` is the text that opens the calls, also used by the
    streaming splitter to know when to stop passing text through."""

    name: str
    marker: str
    # The key the family writes the arguments under.
    arguments_key: str = "arguments"
    # Whether `tool_grammar` can constrain calls written this way.
    constrained: bool = True

    def call_start(self, text: str) -> int | None:
        """Where the calls begin in `text`, once that is certain; None while it is not."""
        index = text.find(self.marker)
        return None if index < 0 else index

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` could still turn into the marker (not safe
        to stream as content yet)."""
        return partial_suffix(text, self.marker)

    def parse(self, text: str) -> ParsedOutput:
        """The calls and the content of a whole output (see the module's contract)."""
        start = self.call_start(text)
        if start is None:
            return ParsedOutput(self.unparsed_content(text))
        try:
            calls, rest = self._parse_calls(text[start:])
        except (ValueError, TypeError, KeyError):
            return ParsedOutput(self.unparsed_content(text))
        if not calls:
            return ParsedOutput(self.unparsed_content(text))
        return ParsedOutput(text[:start] + rest, tuple(calls))

    def unparsed_content(self, text: str) -> str:
        """Text whose calls do not parse, as the content it then is: the text as it came."""
        return text

    @abstractmethod
    def _parse_calls(self, text: str) -> tuple[list[ParsedCall], str]:
        """The calls in `text` (which starts at the marker) and the text after them; raises
        ValueError/TypeError/KeyError when they are malformed."""

    @abstractmethod
    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        """`(name, arguments)` calls as this family writes them (history, instructions)."""

    def _call(self, item: object, key: str | None = None) -> ParsedCall:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise ValueError("a call needs a name")
        arguments = item.get(key or self.arguments_key, {})
        if isinstance(arguments, str):  # some models write the object as a JSON string
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            raise ValueError("arguments must be a JSON object")
        return ParsedCall(item["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser(ToolCallParser):
    name = "hermes"
    marker = "<tool_call>"
    closing = "</tool_call>"
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
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser, HarmonyParser)
}
AUTO = "auto"
TOOL_CALL_PARSERS = (AUTO, *PARSERS)


def detect_tool_parser(chat_template: str) -> ToolCallParser:
    """The family whose call layout the template shows; Hermes when it shows none (the layout
    the gateway renders itself for templates without tools, see `chat_render`)."""
    if harmony.in_template(chat_template):
        return HarmonyParser()
    if MistralParser.marker in chat_template:
        return MistralParser()
    if Llama3JsonParser.marker in chat_template or "ipython" in chat_template:
        return Llama3JsonParser()
    return HermesParser()


def tool_parser(name: str, chat_template: str) -> ToolCallParser:
    """The parser a `--tool-call-parser` value names (`auto`: detected from the template)."""
    return detect_tool_parser(chat_template) if name == AUTO else PARSERS[name]()
