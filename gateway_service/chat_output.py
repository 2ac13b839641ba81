"""A chat's output split into what the API reports separately: reasoning, content, tool calls.

The gateway's text stream (after stop strings) goes through the reasoning splitter first, then
what is content goes through the tool-call splitter. Content before a call's marker streams as
it comes; from the marker on the text is held and parsed when the output ends, so each call is
reported once, whole (one delta with its index, id, name and arguments), on the last chunk. An
output whose calls do not parse gives its held text back as content (the parser's contract).
A chunk's finish reason becomes TOOL_CALLS when calls were parsed from an output that ended by
itself (a LENGTH end stays LENGTH).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from gateway_service.reasoning import ReasoningSplitter
from gateway_service.tool_parsers import ParsedCall, ToolCallParser
from radixserve.v1 import generation_pb2

STOP = generation_pb2.FINISH_REASON_STOP
TOOL_CALLS = generation_pb2.FINISH_REASON_TOOL_CALLS


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallSplitter:
    """Content in, content that is final out; the calls once the output ends."""

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._text = ""
        self._sent = 0
        self._calling = False

    def feed(self, text: str) -> str:
        self._text += text
        if self._calling:
            return ""
        start = self._parser.call_start(self._text)
        if start is not None:
            self._calling = True
            safe = start
        else:
            safe = len(self._text) - self._parser.held_back(self._text)
        out = self._text[self._sent:safe] if safe > self._sent else ""
        self._sent = max(self._sent, safe)
        return out

    def finish(self) -> tuple[str, tuple[ParsedCall, ...]]:
        """The rest of the content and the calls."""
        parsed = self._parser.parse(self._text)
        sent = self._text[:self._sent]
        if parsed.calls and parsed.content.startswith(sent):
            return parsed.content[self._sent:], parsed.calls
        return self._text[self._sent:], ()


class ChatOutputSplitter:
    """Rewrites each chunk of one chat in place: `text` becomes content only, `reasoning_text`
    and (on the last chunk) `tool_calls` are filled."""

    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolCallSplitter | None,
                 call_id: Callable[[], str] = new_call_id) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._call_id = call_id

    def apply(self, chunk: generation_pb2.GenerateResponse) -> None:
        reasoning, content = self._split(chunk.text)
        calls: tuple[ParsedCall, ...] = ()
        if chunk.finish_reason:
            if self._reasoning is not None:
                tail = self._reasoning.flush()
                reasoning += tail.reasoning
                content += self._content(tail.content)
            if self._tools is not None:
                rest, calls = self._tools.finish()
                content += rest
        chunk.text, chunk.reasoning_text = content, reasoning
        for index, call in enumerate(calls):
            chunk.tool_calls.add(index=index, id=self._call_id(), name=call.name, arguments=call.arguments)
        if calls and chunk.finish_reason == STOP:
            chunk.finish_reason = TOOL_CALLS

    def _split(self, text: str) -> tuple[str, str]:
        if self._reasoning is None:
            return "", self._content(text)
        split = self._reasoning.feed(text)
        return split.reasoning, self._content(split.content)

    def _content(self, text: str) -> str:
        return text if self._tools is None else self._tools.feed(text)
