"""A Generate call's chunks by way of a mailbox (generate_call.py): what piles up comes merged,
saying what the chunks said; a failure comes after the chunks before it; leaving early cancels
the request's task. Over gRPC with bare tokens (the lane): test_coalescing.py."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from gateway_service.generate_call import mailbox_chunks, merged
from radixserve.v1 import generation_pb2

Chunk = generation_pb2.GenerateResponse


def chunk(text: str, ids: list[int], **fields) -> Chunk:
    response = Chunk(text=text, token_ids=ids, **fields)
    for token_id in ids:
        response.logprobs.add(token_id=token_id, logprob=-0.5)
    return response


def test_merged_chunks_say_what_the_chunks_said_in_order() -> None:
    first = chunk("Hel", [1], reasoning_text="think ")
    middle = chunk("lo", [2, 3], tool_calls=[generation_pb2.ToolCall(id="call-1", name="f", arguments="{}")])
    last = chunk("!", [4], reasoning_text="done", finish_reason=generation_pb2.FINISH_REASON_STOP,
                 usage=generation_pb2.Usage(prompt_tokens=5, completion_tokens=4))
    together = merged([first, middle, last])
    assert together.text == "Hello!" and together.reasoning_text == "think done"
    assert list(together.token_ids) == [1, 2, 3, 4]
    assert [lp.token_id for lp in together.logprobs] == [1, 2, 3, 4]
    assert [call.id for call in together.tool_calls] == ["call-1"]
    assert together.finish_reason == generation_pb2.FINISH_REASON_STOP
    assert together.usage.completion_tokens == 4
    assert not merged([first, middle]).HasField("usage") and merged([first, middle]).finish_reason == 0
    assert merged([first]) is first


def test_piled_chunks_come_merged_and_a_failure_after_them() -> None:
    async def generate(request, sink):
        sink(chunk("a", [1]))  # by the lane
        yield chunk("b", [2])  # by the stream
        sink(chunk("c", [3]))
        raise ValueError("the request failed")

    async def scenario():
        got = []
        with pytest.raises(ValueError, match="the request failed"):
            async for response in mailbox_chunks(generate, generation_pb2.GenerateRequest()):
                got.append(response)
        return got

    got = asyncio.run(scenario())
    assert "".join(response.text for response in got) == "abc"
    assert [t for response in got for t in response.token_ids] == [1, 2, 3]
    assert len(got) < 3  # they piled up while nobody read: fewer, merged responses


def test_leaving_early_cancels_the_requests_task() -> None:
    cancelled = []

    async def generate(request, sink):
        try:
            yield chunk("a", [1])
            await asyncio.sleep(30)
            yield chunk("never", [2])
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def scenario():
        async with contextlib.aclosing(mailbox_chunks(generate, generation_pb2.GenerateRequest())) as responses:
            async for response in responses:
                assert response.text == "a"
                break

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert cancelled == [True]
