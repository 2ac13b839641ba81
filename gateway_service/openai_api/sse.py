"""Server-sent events of a streamed OpenAI response, as the bytes the response writes.

Every chunk of one response repeats the same header (id, object, created, model) and differs
in its choices, so `ChunkEvents` encodes the header once and each chunk's choices with one
JSON encode; the bytes equal those of encoding the whole body (`ResponseHeader.body`) each
time, keys in the same order.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii

from gateway_service.openai_api.responses import ResponseHeader

MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
# Compact separators, as the JSON bodies have; one encoder, not one per event.
_JSON = json.JSONEncoder(separators=(",", ":"))
_CHOICES_KEY = '"choices":'


def event(payload: dict) -> bytes:
    """One event carrying `payload` as JSON."""
    return b"data: " + _JSON.encode(payload).encode() + b"\n\n"


class ChunkEvents:
    """The chunk events of one response; `with_usage` adds `"usage": null` after the choices
    (`stream_options.include_usage`: the usage comes in a last event of its own)."""

    __slots__ = ("_prefix", "_suffix")

    def __init__(self, header: ResponseHeader, with_usage: bool) -> None:
        encoded = _JSON.encode(header.body(choices=[]))
        cut = encoded.rindex(_CHOICES_KEY) + len(_CHOICES_KEY)
        self._prefix = b"data: " + encoded[:cut].encode()
        self._suffix = (',"usage":null}' if with_usage else "}").encode() + b"\n\n"

    def chunk(self, choices: list[dict]) -> bytes:
        return self._prefix + _JSON.encode(choices).encode() + self._suffix

    # Most of a stream is one choice's new text and nothing else: those events are written from
    # a template, the same bytes as `chunk` of that choice (`_JSON` escapes to ASCII, as
    # `encode_basestring_ascii` does) at a tenth of the encoding's cost.

    def text(self, index: int, text: str) -> bytes:
        """`chunk([completion_choice(index, text, None, unspecified)])`."""
        return b"".join((self._prefix, b'[{"index":%d,"text":' % index, encode_basestring_ascii(text).encode(),
                         b',"logprobs":null,"finish_reason":null}]', self._suffix))

    def content(self, index: int, text: str) -> bytes:
        """`chunk([chat_delta(index, chunk, False, False)])` of a chunk with `text` alone."""
        return b"".join((self._prefix, b'[{"index":%d,"delta":{"content":' % index,
                         encode_basestring_ascii(text).encode(), b'},"logprobs":null,"finish_reason":null}]',
                         self._suffix))
