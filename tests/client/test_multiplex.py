"""AsyncClient(multiplex=True): concurrent requests on shared GenerateMany calls give what a
Generate call each gives, with the same typed errors, and leave nothing open on the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from radixserve_client import (
    AsyncClient, CancelledError, DeadlineExceededError, InvalidArgumentError, UnavailableError,
)
from client.fakes import OPTIONS as SHARED_OPTIONS, TEXT, FailingFirstCall, counting_many_calls
from gateway.harness import EOS_TOKEN_ID
from radixserve.v1 import generation_pb2_grpc

pytestmark = pytest.mark.timeout(60)

OPTIONS = [*SHARED_OPTIONS, {"prompt": "four", "max_tokens": 50, "temperature": 0}]


async def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_concurrent_requests_share_a_call_and_get_what_generate_gives(harness, client_tokenizer):
    harness.script_all(client_tokenizer.encode_prompt(TEXT) + [EOS_TOKEN_ID])
    requests = OPTIONS * 6

    async def scenario():
        async with AsyncClient(harness.address) as alone_client:
            alone = [await alone_client.generate(**options) for options in OPTIONS]
        async with AsyncClient(harness.address, multiplex=True) as client:
            opened = counting_many_calls(client)
            together = await asyncio.gather(*(client.generate(**options) for options in requests))
            chunks = [chunk async for chunk in client.stream(**OPTIONS[0])]
            # Each call ends once nothing is open on it: the gateway finishes it.
            await wait_until(lambda: all(call.reader.done() for call in client._shared._calls))
            return alone, together, chunks, len(opened)

    alone, together, chunks, num_calls = asyncio.run(scenario())
    assert together == alone * 6
    assert alone[0].text == TEXT and alone[1].logprobs and alone[2].finish_reason == "length"
    # The 24 concurrent requests on one call, the stream after them on a second.
    assert num_calls == 2
    assert len(chunks) > 1 and "".join(chunk.text for chunk in chunks) == TEXT
    assert len(harness.all_requests()) == len(OPTIONS) + len(requests) + 1


def test_a_full_call_opens_another(harness, client_tokenizer):
    harness.script_all(client_tokenizer.encode_prompt(TEXT) + [EOS_TOKEN_ID])

    async def scenario():
        async with AsyncClient(harness.address, multiplex=True, window=3) as client:
            opened = counting_many_calls(client)
            results = await asyncio.gather(*(client.generate(prompt="one", max_tokens=50) for _ in range(7)))
            return results, len(opened)

    results, num_calls = asyncio.run(scenario())
    assert num_calls == 3  # 3 + 3 + 1
    assert all(result.text == TEXT for result in results)


def test_a_failed_request_raises_its_typed_error_alone(harness, client_tokenizer):
    harness.script_all(client_tokenizer.encode_prompt(TEXT) + [EOS_TOKEN_ID])

    async def scenario():
        async with AsyncClient(harness.address) as alone_client:
            with pytest.raises(InvalidArgumentError) as alone:
                await alone_client.generate(prompt="bad", temperature=3.0)
        async with AsyncClient(harness.address, multiplex=True) as client:
            outcomes = await asyncio.gather(
                client.generate(prompt="one", max_tokens=50), client.generate(prompt="bad", temperature=3.0),
                client.generate(prompt="one", max_tokens=50), return_exceptions=True)
        return alone.value, outcomes

    alone, (first, failed, last) = asyncio.run(scenario())
    assert type(failed) is InvalidArgumentError and failed.message == alone.message
    assert "sampling.temperature" in failed.message
    assert first.text == last.text == TEXT


def test_leaving_a_stream_early_cancels_its_request_on_the_router(harness, client_tokenizer):
    harness.script_all(client_tokenizer.encode_prompt(TEXT * 4), delay_s=0.05)

    async def scenario():
        async with AsyncClient(harness.address, multiplex=True) as client:
            kept = asyncio.ensure_future(client.generate(prompt="kept", max_tokens=6))
            async with contextlib.aclosing(client.stream(prompt="left", max_tokens=200)) as chunks:
                async for _ in chunks:
                    break
            await wait_until(lambda: len(harness.all_cancelled()) == 1)
            return await kept

    kept = asyncio.run(scenario())
    (left,) = [request for request in harness.all_requests() if request.request_id in harness.all_cancelled()]
    assert left.max_tokens == 200
    assert kept.usage.completion_tokens == 6  # the other request on the call ran on


def test_a_timeout_raises_deadline_exceeded_and_cancels_the_request(harness, client_tokenizer):
    harness.script_all(client_tokenizer.encode_prompt(TEXT * 4), delay_s=0.1)

    async def scenario():
        async with AsyncClient(harness.address, multiplex=True) as client:
            started = time.monotonic()
            with pytest.raises(DeadlineExceededError):
                await client.generate(prompt="slow", max_tokens=200, timeout=0.5)
            waited = time.monotonic() - started
            await wait_until(lambda: len(harness.all_cancelled()) == 1)
            return waited

    waited = asyncio.run(scenario())
    assert 0.5 <= waited < 2.0


def test_closing_the_client_ends_its_open_requests(harness, client_tokenizer):
    harness.script_all(client_tokenizer.encode_prompt(TEXT * 4), delay_s=0.1)

    async def scenario():
        client = AsyncClient(harness.address, multiplex=True)
        pending = asyncio.ensure_future(client.generate(prompt="slow", max_tokens=200))
        await wait_until(lambda: len(harness.all_requests()) == 1)
        await client.close()
        with pytest.raises(CancelledError, match="the client was closed"):
            await pending
        await wait_until(lambda: len(harness.all_cancelled()) == 1)  # the gateway cancelled it on the router

    asyncio.run(scenario())


def test_a_call_that_ends_fails_its_open_requests_and_the_next_opens_a_new_one():
    async def scenario():
        fake = FailingFirstCall(num_first=3)
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with AsyncClient(f"127.0.0.1:{port}", multiplex=True) as client:
                first = await asyncio.gather(*(client.generate(prompt="x") for _ in range(3)), return_exceptions=True)
                after = await client.generate(prompt="x")
            return first, after, fake.num_calls
        finally:
            await server.stop(None)

    first, after, num_calls = asyncio.run(scenario())
    assert all(isinstance(outcome, UnavailableError) and outcome.message == "the gateway went away"
               for outcome in first), first
    assert after.text == "a" and after.finish_reason == "stop"
    assert num_calls == 2


def test_a_window_goes_with_multiplex():
    with pytest.raises(ValueError, match="multiplex=True"):
        AsyncClient("127.0.0.1:1", window=8)
    with pytest.raises(ValueError, match="at least 1"):
        AsyncClient("127.0.0.1:1", multiplex=True, window=0)
