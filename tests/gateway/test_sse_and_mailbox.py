"""The HTTP API's SSE chunk events and the gateway's one-reader mailbox, in process.

Chunk events are built from a header encoded once: their bytes must be exactly those of the
whole body encoded per event (ids, non-ASCII text and model names escaped alike, keys in the
same order). The mailbox hands every item over once, in order, whether it was put before the
reader waited or while it waited, and stays usable after a reader is cancelled.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway_service.mailbox import Mailbox
from gateway_service.openai_api import responses as bodies
from gateway_service.openai_api import sse
from radixserve.v1 import generation_pb2 as pb


@pytest.mark.parametrize("with_usage", [True, False])
def test_chunk_events_equal_the_whole_body_encoded(with_usage) -> None:
    header = bodies.ResponseHeader.new("cmpl", bodies.COMPLETION_OBJECT, 'a "model", naïve')
    choices = [bodies.completion_choice(0, 'café 😀 "choices":[', None, 0, 3),
               bodies.completion_choice(1, "", None, 1, 0)]
    expected = header.body(choices=choices, **({"usage": None} if with_usage else {}))
    event = sse.ChunkEvents(header, with_usage).chunk(choices)
    assert event == b"data: " + json.dumps(expected, separators=(",", ":")).encode() + b"\n\n"
    assert json.loads(event[len(b"data: "):]) == expected
    assert sse.event({"usage": {"n": 1}}) == b'data: {"usage":{"n":1}}\n\n'


def test_mailbox_hands_over_every_item_once_in_order() -> None:
    async def run() -> list:
        box: Mailbox[int] = Mailbox()
        box.put(1)
        box.put(2)
        taken = [await box.take()]  # put before the wait: no wait at all
        reader = asyncio.ensure_future(box.take())
        await asyncio.sleep(0)  # the reader now waits
        asyncio.get_running_loop().call_soon(box.put, 3)
        asyncio.get_running_loop().call_soon(box.put, 4)
        taken.append(await reader)
        # A reader cancelled while waiting leaves the mailbox usable for the next one.
        cancelled = asyncio.ensure_future(box.take())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        box.put(5)
        taken.append(await asyncio.wait_for(box.take(), timeout=5))
        return taken

    assert asyncio.run(run()) == [[1, 2], [3, 4], [5]]


@settings(max_examples=200, deadline=None)
@given(text=st.text(min_size=1, max_size=40), index=st.integers(min_value=0, max_value=300), with_usage=st.booleans())
def test_a_text_events_template_writes_the_bytes_of_the_encoded_choice(text, index, with_usage) -> None:
    """`ChunkEvents.text` / `.content` (a step's new text alone) equal encoding the choice the
    general way, for any text: quotes, controls, non-ASCII, lone surrogates."""
    header = bodies.ResponseHeader("cmpl-x", "text_completion", 1, "m\"odel")
    events = sse.ChunkEvents(header, with_usage)
    choice = bodies.completion_choice(index, text, None, pb.FINISH_REASON_UNSPECIFIED)
    assert events.text(index, text) == events.chunk([choice])
    delta = bodies.chat_delta(index, pb.GenerateResponse(text=text.encode("utf-8", "surrogatepass").decode(
        "utf-8", "replace")), False, False)
    assert events.content(index, delta["delta"]["content"]) == events.chunk([delta])
