"""A Stream call to a router that breaks after the router answered on it (grpc's INTERNAL
"Internal error from Core", or a cancel from the server's side, as a router stopping mid-call
can give) fails its requests with UNAVAILABLE: they lost their router, and a request that had
streamed nothing fails over. Before the router answered, INTERNAL stays INTERNAL (the race of
a router without Stream, router_choice.py)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from gateway_service.router_stream import RouterStream
from radixserve.serving import start_server
from radixserve.v1 import router_pb2, router_pb2_grpc

ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


class _BreakingRouter(router_pb2_grpc.RouterServiceServicer):
    """Answers each opened request with one token (its first update), then, once `answer_first`
    requests had theirs, ends the call with `code`."""

    def __init__(self, code: grpc.StatusCode, answer_first: int) -> None:
        self.code = code
        self.answer_first = answer_first

    async def Stream(self, request_iterator, context):
        answered = 0
        async for message in request_iterator:
            if answered == self.answer_first:
                await context.abort(self.code, "broken")
            update = router_pb2.RouterStreamUpdate(request_id=message.open.request_id)
            update.response.token_ids.append(11)
            update.response.usage.completion_tokens = 1
            yield router_pb2.RouterStreamResponse(updates=[update])
            answered += 1


async def _outcome(stream: RouterStream, request_id: str) -> tuple[list[int], grpc.StatusCode, str]:
    tokens: list[int] = []
    request = router_pb2.RouterGenerateRequest(request_id=request_id, prompt_token_ids=[3], max_tokens=5)
    try:
        async for response in stream.generate(request, time.monotonic() + 10):
            tokens.extend(response.token_ids)
    except grpc.aio.AioRpcError as exc:
        return tokens, exc.code(), exc.details()
    raise AssertionError("the request ended without the call's failure")


def _run(code: grpc.StatusCode, answer_first: int) -> list[tuple[list[int], grpc.StatusCode, str]]:
    async def scenario():
        server, _, port = await start_server(
            "127.0.0.1", 0,
            [lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(_BreakingRouter(code, answer_first), s)],
            [ROUTER_SERVICE])
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stream = RouterStream(router_pb2_grpc.RouterServiceStub(channel), ())
        try:
            first = asyncio.ensure_future(_outcome(stream, "a"))
            if answer_first:
                await asyncio.wait_for(_until(lambda: stream.answered), 5)
            second = asyncio.ensure_future(_outcome(stream, "b"))
            return await asyncio.wait_for(asyncio.gather(first, second), 10)
        finally:
            await stream.close()
            await channel.close()
            await server.stop(0)

    return asyncio.run(scenario())


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED])
def test_a_call_that_breaks_after_answering_fails_its_requests_as_unavailable(code) -> None:
    (first_tokens, first_code, first_details), (second_tokens, second_code, _) = _run(code, answer_first=1)
    assert first_tokens == [11]  # it streamed: the caller gets UNAVAILABLE, as on a connection reset
    assert first_code == grpc.StatusCode.UNAVAILABLE and code.name in first_details
    assert second_tokens == [] and second_code == grpc.StatusCode.UNAVAILABLE  # failover moves it


@pytest.mark.timeout(30)
def test_internal_before_any_answer_stays_internal() -> None:
    (tokens, status, _), _ = _run(grpc.StatusCode.INTERNAL, answer_first=0)
    assert tokens == [] and status == grpc.StatusCode.INTERNAL
