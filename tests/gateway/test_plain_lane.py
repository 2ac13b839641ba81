"""The plain-token lane (gateway_service/plain_lane.py, router_stream.py): bare tokens handed to
the caller by the router stream's reader, not by the request's task. Over a real Stream call on
127.0.0.1: the lane and the task's way together give every token once, in order, whether the
caller keeps up or not; the task's responses count the lane's tokens in their usage; a declined
token takes the task's way; a lane that raises fails its request alone, and the router is told
to cancel it. The assembler's lane: the same chunks as `add_plain`, none with stop strings, and
a long detokenizer window declined. End to end (GenerateMany and HTTP against Generate):
test_generate_many.py and test_coalescing.py."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from gateway_service.output import CHEAP_WINDOW, OutputAssembler
from gateway_service.plain_lane import plain_lane
from gateway_service.router_stream import RouterStream
from radixserve.serving import start_server
from radixserve.v1 import generation_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.timeout(30)
ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name
NUM_TOKENS = 60
PROMPT_TOKENS = 5
CACHED_TOKENS = 3
TOKEN_GAP_S = 0.002


def _update(request_id: str, token_ids: list[int], completion: int, finish: int = 0) -> router_pb2.RouterStreamUpdate:
    update = router_pb2.RouterStreamUpdate(request_id=request_id)
    response = update.response
    response.token_ids.extend(token_ids)
    response.finish_reason = finish
    usage = response.usage
    usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens = PROMPT_TOKENS, completion, CACHED_TOKENS
    return update


def _tokens_of(request_id: str) -> list[int]:
    base = 1000 * int(request_id.rsplit("-", 1)[1])
    return [base + i for i in range(NUM_TOKENS)]


class _PacedRouter(router_pb2_grpc.RouterServiceServicer):
    """Each opened request (id `name-K`) gets tokens 1000K.. one a message, TOKEN_GAP_S apart:
    the first and the last as updates with usage, the others bare. Cancels are recorded."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def Stream(self, request_iterator, context):
        out: asyncio.Queue[router_pb2.RouterStreamResponse] = asyncio.Queue()
        tasks = []

        async def serve(request_id: str) -> None:
            tokens = _tokens_of(request_id)
            for index, token_id in enumerate(tokens):
                if request_id in self.cancelled:
                    return
                if index == 0 or index == len(tokens) - 1:
                    finish = generation_pb2.FINISH_REASON_LENGTH if index else 0
                    message = router_pb2.RouterStreamResponse(updates=[_update(request_id, [token_id], index + 1, finish)])
                else:
                    message = router_pb2.RouterStreamResponse(bare_request_ids=[request_id], bare_token_ids=[token_id])
                await out.put(message)
                await asyncio.sleep(TOKEN_GAP_S)

        async def read() -> None:
            async for message in request_iterator:
                if message.HasField("open"):
                    tasks.append(asyncio.ensure_future(serve(message.open.request_id)))
                else:
                    self.cancelled.append(message.cancel)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                yield await out.get()
        finally:
            reader.cancel()
            for task in tasks:
                task.cancel()


async def _with_stream(router: _PacedRouter, body) -> None:
    server, _, port = await start_server(
        "127.0.0.1", 0, [lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(router, s)], [ROUTER_SERVICE])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stream = RouterStream(router_pb2_grpc.RouterServiceStub(channel), ())
    try:
        await asyncio.wait_for(body(stream), 20)
    finally:
        await stream.close()
        await channel.close()
        await server.stop(0)


def _request(request_id: str) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3, 4, 5],
                                            max_tokens=NUM_TOKENS)


def test_lane_and_task_together_give_every_token_once_in_order_with_usage() -> None:
    """The lane declines every tenth token, which wakes the task; the caller is then busy with
    it before passing it on, so the tokens that arrive meanwhile must wait for the task (they
    pile up), and once it waits again they go by the lane."""
    router = _PacedRouter()
    delivered: list[int] = []
    by_lane: list[int] = []
    usages: list[tuple[int, int]] = []  # (tokens delivered so far, the response's completion count)
    piled = 0  # responses of more than one token

    def lane(token_id: int) -> bool:
        if token_id % 10 == 0:
            return False
        delivered.append(token_id)
        by_lane.append(token_id)
        return True

    async def body(stream: RouterStream) -> None:
        nonlocal piled
        async for response in stream.generate(_request("r-1"), time.monotonic() + 15, lane):
            if any(token_id % 10 == 0 for token_id in response.token_ids):
                # Busy with the response before passing it on (as a decode in a thread is).
                await asyncio.sleep(5 * TOKEN_GAP_S)
            delivered.extend(response.token_ids)
            piled += len(response.token_ids) > 1
            usages.append((len(delivered), response.usage.completion_tokens))
            assert response.usage.prompt_tokens == PROMPT_TOKENS
            assert response.usage.cached_tokens == CACHED_TOKENS
        assert response.finish_reason == generation_pb2.FINISH_REASON_LENGTH

    asyncio.run(_with_stream(router, body))
    assert delivered == _tokens_of("r-1")
    assert by_lane and piled, "both ways must have been taken"
    assert all(count == completion for count, completion in usages)
    assert router.cancelled == []


def test_a_lane_that_raises_fails_its_request_alone_and_cancels_it_on_the_router() -> None:
    router = _PacedRouter()
    seen: list[int] = []

    def failing(token_id: int) -> bool:
        seen.append(token_id)
        if len(seen) == 3:
            raise ValueError("the lane broke")
        return True

    async def body(stream: RouterStream) -> None:
        async def broken() -> None:
            with pytest.raises(ValueError, match="the lane broke"):
                async for _ in stream.generate(_request("r-3"), time.monotonic() + 15, failing):
                    pass

        async def healthy() -> list[int]:
            tokens: list[int] = []
            async for response in stream.generate(_request("r-4"), time.monotonic() + 15,
                                                  lambda token_id: tokens.append(token_id) is None):
                tokens.extend(response.token_ids)
            return tokens

        _, tokens = await asyncio.gather(broken(), healthy())
        assert tokens == _tokens_of("r-4")
        for _ in range(200):  # the cancel is written in the background
            if router.cancelled:
                break
            await asyncio.sleep(0.01)

    asyncio.run(_with_stream(router, body))
    assert router.cancelled == ["r-3"]
    assert seen[:3] == _tokens_of("r-3")[1:4]


def test_the_assembler_lane_gives_add_plains_chunks_and_declines_what_is_not_cheap(tokenizer) -> None:
    token_ids = tokenizer.encode_prompt("Lanes carry plain tokens: naïve café 😀 世界, and the rest.",
                                        add_special_tokens=False)
    reference = OutputAssembler(tokenizer, (), 4)
    expected = [reference.add_plain([token_id]) for token_id in token_ids]

    chunks: list[generation_pb2.GenerateResponse] = []
    lane = plain_lane(OutputAssembler(tokenizer, (), 4), None, chunks.append)
    assert all(lane(token_id) for token_id in token_ids)
    assert chunks == [chunk for chunk in expected if chunk is not None]

    assert plain_lane(OutputAssembler(tokenizer, ("stop",), 4), None, chunks.append) is None

    # Text held back over a long window (here: a run of a character split over byte tokens that
    # never completes) is not cheap: the lane declines and the task's way decodes it in a thread.
    held = OutputAssembler(tokenizer, (), 4)
    lane = plain_lane(held, None, chunks.append)
    byte_token = tokenizer.encode_prompt("😀", add_special_tokens=False)[0]
    answers = [lane(byte_token) for _ in range(CHEAP_WINDOW + 8)]
    assert answers[0] is True and answers[-1] is False
