"""What a tool-call parser is: a family's call layout, read back into (name, arguments).

Contract of `parse`: it never raises. Either every call in the text is well formed (a name and a
JSON object of arguments), and the calls come back with the rest of the text as content, or the
text comes back whole as content with no calls (`unparsed_content`: the text itself, harmony's
without its markers): a half-parsed output is never half-reported. The grammar side
(`tool_grammar`) emits exactly the layout each parser reads, where the family has a grammar
(`constrained`).

Streaming (`chat_output.ToolCallSplitter`): content streams until `call_start` finds the calls'
marker, holding back the `held_back` characters that could still become it; from the marker on,
`partial_calls` says what the calls hold so far. A family with a JSON object of arguments after
a header names its headers (`call_headers`, see `tool_call_stream`) and its arguments stream as
they are written; a family that writes its arguments as tagged text reports each call whole
once it is closed (`TaggedBlockParser`). The families are in `tool_parsers` (the registry and
the detection from a chat template), `tool_parsers_tagged` and `tool_parsers_sections`.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from gateway_service.text_markers import partial_suffix
from gateway_service.tool_call_stream import PartialCall, partial_calls
from radixserve.v1 import generation_pb2

T = TypeVar("T")


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
    # A tag only this family's chat templates write, by which `detect_tool_parser` knows it ("": none).
    cue: str = ""
    # The other tags the parser reads: where one is a single special token, output text keeps it
    # (`ChatFormat.detect`), as it keeps the marker.
    inner_tags: tuple[str, ...] = ()
    # The key the family writes the arguments under.
    arguments_key: str = "arguments"
    # Whether `tool_grammar` can constrain calls written this way.
    constrained: bool = True
    # The headers after which a call's arguments (a JSON object) stream (`tool_call_stream`).
    call_headers: tuple[re.Pattern, ...] = ()

    def with_tools(self, tools: Sequence[generation_pb2.Tool]) -> "ToolCallParser":
        """This parser for one request's tools: the same, but for a family whose layout needs the
        tools' schemas to read a call's values (`tool_parsers_tagged`)."""
        return self

    def call_start(self, text: str) -> int | None:
        """Where the calls begin in `text`, once that is certain; None while it is not."""
        index = text.find(self.marker)
        return None if index < 0 else index

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` could still turn into the marker (not safe
        to stream as content yet)."""
        return partial_suffix(text, self.marker)

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls readable so far in `text` (an output from `call_start` on), in order; only
        the last may be incomplete. Their names and complete arguments are those `parse` gives
        once the calls parse."""
        return partial_calls(text, self.call_headers)

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


class BlockParser(ToolCallParser):
    """Calls written in blocks, each from `marker` to `closing` (one call or several, as the
    family writes them), with content before, between and after them. A block not closed, or
    holding no call, is malformed (the closing tag is no end-of-sequence token in these
    families: an output without it was cut short)."""

    closing: str

    @abstractmethod
    def _read_block(self, body: str) -> list[ParsedCall]:
        """The calls in a block's body (between its tags); raises ValueError when malformed."""

    def _parse_calls(self, text: str) -> tuple[list[ParsedCall], str]:
        calls, between, position = [], [], 0
        for start, end in self._blocks(text):
            if end is None:
                raise ValueError("a block is not closed")
            between.append(text[position:start])
            block = self._read_block(text[start + len(self.marker):end])
            if not block:
                raise ValueError("a block without calls")
            calls.extend(block)
            position = end + len(self.closing)
        between.append(text[position:])
        rest = "".join(between)
        return calls, "" if not rest.strip() else rest

    def _blocks(self, text: str) -> Iterator[tuple[int, int | None]]:
        """Each block's start and the start of its closing tag (None: the last, still open)."""
        position = 0
        while (start := text.find(self.marker, position)) >= 0:
            end = text.find(self.closing, start + len(self.marker))
            yield start, (None if end < 0 else end)
            if end < 0:
                return
            position = end + len(self.closing)


def read_sequence(pattern: re.Pattern, text: str, read: Callable[[re.Match], T], whole: bool = True) -> list[T]:
    """`text` as items, each a match of `pattern` (which allows the blanks before it) right after
    the last, read by `read`. `whole`: only blanks may follow them (else ValueError); otherwise
    the items up to the first that does not match yet (a block still being written)."""
    items, position = [], 0
    while (match := pattern.match(text, position)) is not None:
        items.append(read(match))
        position = match.end()
    if whole and text[position:].strip():
        raise ValueError("text between calls that is no call")
    return items
