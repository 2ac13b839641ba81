"""A chat's output split into what the API reports separately: reasoning, content, tool calls.

The gateway's text stream (after stop strings) goes through the reasoning splitter first (the
`<think>` one, or harmony's, which also passes calls on, see `harmony_splitter`), then what is
content goes through the tool-call splitter. Content before a call's marker streams as it
comes; from the marker on the text is held and parsed when the output ends. Whole calls (a
non-streamed HTTP answer): each call is reported once (its index, id, name and arguments) on the
last chunk, and an output whose calls do not parse gives its held text back as content (the
parser's contract; harmony's without its markers). Incremental calls (streams): a call's first
delta (index, id, name and the arguments so far) goes out as soon as its name is complete, then
each chunk carries the new arguments text (`tool_call_stream`), and the last chunk the rest; the
arguments' pieces concatenate to the text the model wrote (valid JSON whenever the calls parse).
A family whose arguments are tagged text sends each call whole, once it is closed
(`ToolCallParser.partial_calls`).
The chunk that ends the output may hold whole calls (tokens coalesced for a consumer behind,
drafts accepted together): they go out there, named, as if streamed. Once a piece of a call has
been streamed, an output that ends without parsing (cut by max_tokens) gives nothing back as
content: the deltas sent stand, with the last chunk's piece, and the finish reason says why it
ended; cut before any piece went out, its text is content, as in a non-streamed answer.
A chunk's finish reason becomes TOOL_CALLS when calls were parsed from an output that ended by
itself (a LENGTH end stays LENGTH).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from dataclasses import dataclass

from gateway_service.chat_format import ChatFormat, ChatPlan
from gateway_service.harmony import HARMONY
from gateway_service.harmony_splitter import HarmonySplitter
from gateway_service.reasoning import ReasoningSplitter, opens_inside_block
from gateway_service.tokenizer import Tokenizer
from gateway_service.tool_parser_base import ParsedCall, ToolCallParser
from radixserve.v1 import generation_pb2

# The end of a chat prompt that says whether the template opened a thinking block for the model.
PROMPT_TAIL_TOKENS = 16
STOP = generation_pb2.FINISH_REASON_STOP
TOOL_CALLS = generation_pb2.FINISH_REASON_TOOL_CALLS


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A piece of call `index`: `name` on its first piece only (then it needs an id)."""

    index: int
    name: str | None
    arguments: str


class ToolCallSplitter:
    """Content in, content that is final out; the calls once the output ends, and with
    `incremental` their pieces as they are generated (`deltas`, then `final_deltas`)."""

    def __init__(self, parser: ToolCallParser, incremental: bool = False) -> None:
        self._parser = parser
        self._incremental = incremental
        self._text = ""
        self._sent = 0
        self._calling = False
        # Incremental: the arguments text sent so far, per call streamed.
        self._streamed: list[str] = []

    def deltas(self) -> list[CallDelta]:
        """Incremental: what the calls gained since the last call (nothing before the marker)."""
        if not self._incremental or not self._calling:
            return []
        found = []
        for index, call in enumerate(self._parser.partial_calls(self._text[self._sent:])):
            if index == len(self._streamed):
                self._streamed.append(call.arguments)
                found.append(CallDelta(index, call.name, call.arguments))
            elif len(call.arguments) > len(self._streamed[index]):
                found.append(CallDelta(index, None, call.arguments[len(self._streamed[index]):]))
                self._streamed[index] = call.arguments
        return found

    def final_deltas(self, calls: tuple[ParsedCall, ...]) -> list[CallDelta]:
        """The parsed `calls` (from `finish`) as the pieces not streamed yet: what the calls
        gained in the last chunk (a call's first piece too: the whole output may come in one
        chunk), the rest of each streamed call's arguments text, and every call not streamed,
        whole. Calls that do not parse give pieces only when some were streamed before (the
        output then ends with them, cut); else their text was content (`finish`)."""
        if not calls and not self._streamed:
            return []
        found = self.deltas()
        for index, call in enumerate(calls):
            if index >= len(self._streamed):
                found.append(CallDelta(index, call.name, call.arguments))
                continue
            sent = self._streamed[index]
            # The streamed text is the model's own: it already parses as these arguments.
            if sent != call.arguments and call.arguments.startswith(sent):
                found.append(CallDelta(index, None, call.arguments[len(sent):]))
        return found

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
        """The rest of the content and the calls (then `final_deltas`: the pieces of the last
        chunk are not taken here, so none is lost)."""
        parsed = self._parser.parse(self._text)
        sent = self._text[:self._sent]
        if parsed.calls and parsed.content.startswith(sent):
            return parsed.content[self._sent:], parsed.calls
        if self._streamed:
            return "", ()  # the streamed calls' text is not content too
        return self._parser.unparsed_content(self._text[self._sent:]), ()


class ChatOutputSplitter:
    """Rewrites each chunk of one chat in place: `text` becomes content only, `reasoning_text`
    and (on the last chunk) `tool_calls` are filled."""

    def __init__(self, reasoning: ReasoningSplitter | HarmonySplitter | None, tools: ToolCallSplitter | None,
                 call_id: Callable[[], str] = new_call_id) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._call_id = call_id

    def apply(self, chunk: generation_pb2.GenerateResponse) -> None:
        reasoning, content = self._split(chunk.text)
        calls: tuple[ParsedCall, ...] = ()
        deltas: list[CallDelta] = []
        if chunk.finish_reason:
            if self._reasoning is not None:
                tail = self._reasoning.flush()
                reasoning += tail.reasoning
                content += self._content(tail.content)
            if self._tools is not None:
                rest, calls = self._tools.finish()
                content += rest
                deltas = self._tools.final_deltas(calls)
        elif self._tools is not None:
            deltas = self._tools.deltas()
        chunk.text, chunk.reasoning_text = content, reasoning
        for delta in deltas:
            call = chunk.tool_calls.add(index=delta.index, arguments=delta.arguments)
            if delta.name is not None:
                call.id, call.name = self._call_id(), delta.name
        if calls and chunk.finish_reason == STOP:
            chunk.finish_reason = TOOL_CALLS

    def _split(self, text: str) -> tuple[str, str]:
        if self._reasoning is None:
            return "", self._content(text)
        split = self._reasoning.feed(text)
        return split.reasoning, self._content(split.content)

    def _content(self, text: str) -> str:
        return text if self._tools is None else self._tools.feed(text)


def prompt_opens_block(prompt_ids: list[int], tokenizer: Tokenizer) -> bool:
    """Whether the rendered prompt ends inside an open `<think>` block (the output starts there)."""
    return opens_inside_block(tokenizer.decode_all(prompt_ids[-PROMPT_TAIL_TOKENS:]))


def output_splitter(plan: ChatPlan, prompt_ids: list[int], tokenizer: Tokenizer, chat: ChatFormat,
                    incremental_calls: bool) -> ChatOutputSplitter | None:
    """What splits a request's output into reasoning, content and calls, as `plan` says (None:
    nothing to split); a reasoning block the prompt's template opened starts the output inside it."""
    if not plan.split_reasoning and not plan.parse_tools:
        return None
    reasoning: ReasoningSplitter | HarmonySplitter | None = None
    if plan.split_reasoning and chat.reasoning == HARMONY:
        reasoning = HarmonySplitter(plan.parse_tools)
    elif plan.split_reasoning:
        reasoning = ReasoningSplitter(prompt_opens_block(prompt_ids, tokenizer))
    tools = ToolCallSplitter(chat.tool_parser.with_tools(plan.tools), incremental_calls) if plan.parse_tools else None
    return ChatOutputSplitter(reasoning, tools)
