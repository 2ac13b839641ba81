"""Bare tokens (router.proto, `RouterStreamResponse.bare_token_ids`) as the gateway reads them:
what piled up for a request (updates and bare tokens in any mix, as a caller behind the router's
steps takes them) reads as one response with the tokens in order and the usage of the last; a
message whose columns do not pair up fails the call.
End to end over gRPC and HTTP: test_coalescing.py; against the real router:
tests/router/test_request_stream.py."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from gateway_service.router_stream import BareTokens, RouterStream, _merged
from radixserve.serving import start_server
from radixserve.v1 import generation_pb2, router_pb2, router_pb2_grpc

ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


def update(token_ids: list[int], completion: int, finish: int = 0) -> router_pb2.RouterStreamUpdate:
    message = router_pb2.RouterStreamUpdate(request_id="r")
    message.response.token_ids.extend(token_ids)
    message.response.finish_reason = finish
    usage = message.response.usage
    usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens = 7, completion, 4
    usage.draft_tokens, usage.accepted_draft_tokens = 3, 2
    return message


def read(response) -> tuple:
    usage = response.usage
    return (list(response.token_ids), list(response.logprobs), response.finish_reason,
            (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens, usage.draft_tokens,
             usage.accepted_draft_tokens))


def test_bare_tokens_after_an_update_count_on_its_usage() -> None:
    first = update([11, 12], 2)
    assert read(_merged([first, 13, 14], None)) == ([11, 12, 13, 14], [], 0, (7, 4, 4, 3, 2))
    alone = BareTokens([13], first.response.usage)
    assert read(alone) == ([13], [], 0, (7, 3, 4, 3, 2))
    # A run of bare tokens goes on from the usage the response before left.
    assert read(_merged([14, 15], alone.usage)) == ([14, 15], [], 0, (7, 5, 4, 3, 2))


def test_the_last_update_of_a_mix_gives_its_usage_and_finish_reason() -> None:
    before = BareTokens([12], update([11], 1).response.usage).usage
    last = update([15], 4, generation_pb2.FINISH_REASON_LENGTH)
    assert read(_merged([13, 14, last], before)) == (
        [13, 14, 15], [], generation_pb2.FINISH_REASON_LENGTH, (7, 4, 4, 3, 2))
    middle = update([14], 3)
    assert read(_merged([13, middle, 15, 16], before)) == ([13, 14, 15, 16], [], 0, (7, 5, 4, 3, 2))


def test_a_bare_token_before_any_update_is_the_routers_fault() -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        BareTokens([5], None)
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    with pytest.raises(grpc.aio.AioRpcError):
        _merged([5, 6], None)
    with pytest.raises(grpc.aio.AioRpcError):  # bare before the first update, in a mix
        _merged([5, update([6], 2)], None)


class _MismatchedColumnsRouter(router_pb2_grpc.RouterServiceServicer):
    """Answers an opened request with its first update, then a message whose bare columns do not
    pair up (a router bug)."""

    async def Stream(self, request_iterator, context):
        async for message in request_iterator:
            request_id = message.open.request_id
            yield router_pb2.RouterStreamResponse(updates=[update([11], 1)], load=router_pb2.RouterLoad())
            yield router_pb2.RouterStreamResponse(bare_request_ids=[request_id, request_id], bare_token_ids=[12])
            await asyncio.sleep(30)  # the gateway must not wait for more


@pytest.mark.timeout(20)
def test_bare_columns_that_do_not_pair_up_fail_the_call_not_a_guess() -> None:
    async def scenario() -> None:
        server, _, port = await start_server(
            "127.0.0.1", 0, [lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(_MismatchedColumnsRouter(), s)],
            [ROUTER_SERVICE])
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stream = RouterStream(router_pb2_grpc.RouterServiceStub(channel), ())
        tokens = []
        try:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                request = router_pb2.RouterGenerateRequest(request_id="r", prompt_token_ids=[3], max_tokens=5)
                async for response in stream.generate(request, time.monotonic() + 10):
                    tokens.extend(response.token_ids)
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            assert "2 request ids" in caught.value.details()
            assert tokens == [11]
            assert stream.failed is not None
        finally:
            await stream.close()
            await channel.close()
            await server.stop(0)

    asyncio.run(scenario())
