"""A harmony output (gpt-oss) routed message by message, as text streams in: the reasoning stage
of a chat's output (`chat_output`) for the harmony format, in place of `reasoning`'s `<think>`
splitter and with its interface (`feed`, `flush`, each returning a `Split`).

How harmony fits the two stages. A chat's output goes through a reasoning stage, then its
content through the tool-call stage (`ToolCallSplitter` with a `ToolCallParser`). Harmony frames
reasoning, answers and calls alike as messages, so this stage reads the framing for both: an
`analysis` message's body is reasoning; a `final` message's, a preamble's (`commentary` with no
recipient) and a message without a channel are content; a message to `functions.NAME` is a call,
passed on to the tool-call stage inside the content, written as one harmony call message
(`harmony.call_header(NAME)`, the body as the model writes it, then `<|call|>` once the body has
ended), which `tool_parsers.HarmonyParser` reads like any other family's calls: so streamed
arguments, the finish reason, and a call cut short or malformed behave as for every family. The
content this stage passes on has no marker in it but those of calls. With calls not parsed (no
tools, `tool_choice: none`) a call's body is content. A message to another recipient (the
model's built-in tools, which this API does not run) is reasoning.

Messages follow each other; the bodies going the same way are concatenated as they are. Text
outside any message frame (an output that is not harmony at all) is content; a header cut short
(max_tokens) is dropped, being only markup; a body cut short is what it is, so an output cut
inside the analysis is all reasoning, as with `<think>`.
"""

from __future__ import annotations

from gateway_service import harmony
from gateway_service.reasoning import Split

# Where a message's body goes.
REASONING, CONTENT, CALL = range(3)


class HarmonySplitter:
    """Feed text pieces with `feed`, then `flush` once; each returns what became final."""

    _HEADER, _BODY = range(2)

    def __init__(self, parse_calls: bool) -> None:
        self._parse_calls = parse_calls
        self._state = self._HEADER
        self._route = CONTENT
        self._pending = ""

    def feed(self, text: str) -> Split:
        self._pending += text
        out = Split()
        while True:
            pending = self._pending
            if self._state == self._HEADER:
                stop = harmony.HEADER_STOP.search(pending)
                if stop is None:
                    return out  # a header, or text outside any frame: what ends it says which
                header = pending[:stop.start()]
                if stop.group() == harmony.MESSAGE:
                    self._open(harmony.read_header(header), out)
                else:  # <|start|> or an end before any body: what stood before opened none
                    out.content += _unframed(header)
                self._pending = pending[stop.end():]
                continue
            found = harmony.MARKER.search(pending)  # a body ends at any marker
            if found is None:
                keep = harmony.held_marker(pending)
                self._emit(pending[:len(pending) - keep], out)
                self._pending = pending[len(pending) - keep:]
                return out
            self._emit(pending[:found.start()], out)
            self._close(out)
            self._state = self._HEADER
            # A header that follows without its <|start|> begins at its own marker.
            starts_header = found.group() in (harmony.CHANNEL, harmony.CONSTRAIN, harmony.MESSAGE)
            self._pending = pending[found.start() if starts_header else found.end():]

    def flush(self) -> Split:
        out = Split()
        pending, self._pending = self._pending, ""
        if self._state == self._BODY:
            self._emit(pending, out)  # cut short: the body so far, a call left open
        else:
            out.content += _unframed(pending)
        return out

    def _open(self, header: harmony.Header, out: Split) -> None:
        self._state = self._BODY
        if header.function is not None:
            self._route = CALL if self._parse_calls else CONTENT
        elif header.recipient is not None or header.channel == harmony.ANALYSIS:
            self._route = REASONING
        else:
            self._route = CONTENT
        if self._route == CALL:
            out.content += harmony.call_header(header.function)

    def _emit(self, text: str, out: Split) -> None:
        if self._route == REASONING:
            out.reasoning += text
        else:
            out.content += text

    def _close(self, out: Split) -> None:
        if self._route == CALL:
            out.content += harmony.CALL


def _unframed(text: str) -> str:
    """Text between frames: content when it holds no marker and is not blank (the model wrote
    plain text), else dropped (markup of a frame that opened no body, blanks between frames)."""
    return "" if harmony.MARKER.search(text) or not text.strip() else text
