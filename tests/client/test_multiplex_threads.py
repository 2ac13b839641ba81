"""Client(multiplex=True): requests from many threads on shared GenerateMany calls give what a
Generate call each gives, with the same typed errors, and leave nothing open on the gateway."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from client.fakes import OPTIONS as SHARED_OPTIONS, TEXT, FailingFirstCall, counting_many_calls
from gateway.background import BackgroundLoop
from gateway.harness import EOS_TOKEN_ID
from radixserve_client import Client, CancelledError, DeadlineExceededError, InvalidArgumentError, UnavailableError
from radixserve.v1 import generation_pb2_grpc

pytestmark = pytest.mark.timeout(60)

OPTIONS = [*SHARED_OPTIONS, {"prompt": "bad", "temperature": 3.0}]


def outcome(client: Client, options: dict):
    try:
        return client.generate(**options)
    except InvalidArgumentError as exc:
        return exc


def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_requests_from_many_threads_get_what_generate_gives(harness, client_tokenizer):
    harness.script_all(client_tokenizer.encode_prompt(TEXT) + [EOS_TOKEN_ID], delay_s=0.01)
    requests = OPTIONS * 6
    with Client(harness.address) as alone_client:
        alone = [outcome(alone_client, options) for options in OPTIONS]
    with Client(harness.address, multiplex=True) as client:
        opened = counting_many_calls(client)
        all_started = threading.Barrier(len(requests))

        def together_with_the_others(options: dict):
            all_started.wait(timeout=30)
            return outcome(client, options)

        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            together = list(pool.map(together_with_the_others, requests))
        # Each call ends once nothing is open on it: the gateway finishes it.
        wait_until(lambda: not any(call.reader.is_alive() for call in client._shared._calls))
    for got, expected in zip(together, alone * 6):
        if isinstance(expected, InvalidArgumentError):
            assert type(got) is InvalidArgumentError and got.message == expected.message
        else:
            assert got == expected
    assert alone[0].text == TEXT and alone[1].logprobs and alone[2].finish_reason == "length"
    assert len(opened) < len(requests) // 4  # shared, not a call each


def test_closing_a_stream_early_and_a_timeout_cancel_their_requests(harness, client_tokenizer):
    harness.script_all(client_tokenizer.encode_prompt(TEXT * 4), delay_s=0.1)
    with Client(harness.address, multiplex=True) as client:
        with ThreadPoolExecutor(max_workers=1) as pool:
            kept = pool.submit(client.generate, prompt="kept", max_tokens=6)
            with contextlib.closing(client.stream(prompt="left", max_tokens=200)) as chunks:
                next(chunks)
            wait_until(lambda: len(harness.all_cancelled()) == 1)
            started = time.monotonic()
            with pytest.raises(DeadlineExceededError):
                client.generate(prompt="slow", max_tokens=200, timeout=0.5)
            waited = time.monotonic() - started
            wait_until(lambda: len(harness.all_cancelled()) == 2)
            assert kept.result(timeout=30).usage.completion_tokens == 6  # ran on beside them
    cancelled = {r.max_tokens for r in harness.all_requests() if r.request_id in harness.all_cancelled()}
    assert cancelled == {200}
    assert 0.5 <= waited < 2.0


def test_closing_the_client_ends_its_open_requests(harness, client_tokenizer):
    harness.script_all(client_tokenizer.encode_prompt(TEXT * 4), delay_s=0.1)
    client = Client(harness.address, multiplex=True)
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(client.generate, prompt="slow", max_tokens=200)
        wait_until(lambda: len(harness.all_requests()) == 1)
        client.close()
        with pytest.raises(CancelledError, match="the client was closed"):
            pending.result(timeout=10)
    wait_until(lambda: len(harness.all_cancelled()) == 1)  # the gateway cancelled it on the router


def test_a_call_that_ends_fails_its_open_requests_and_the_next_opens_a_new_one():
    loop = BackgroundLoop()
    fake = FailingFirstCall(num_first=3)

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop.run(start())
    try:
        with Client(f"127.0.0.1:{port}", multiplex=True) as client:
            barrier = threading.Barrier(3)

            def one():
                barrier.wait(timeout=10)
                try:
                    return client.generate(prompt="x")
                except UnavailableError as exc:
                    return exc

            with ThreadPoolExecutor(max_workers=3) as pool:
                first = list(pool.map(lambda _: one(), range(3)))
            after = client.generate(prompt="x")
    finally:
        loop.run(server.stop(None))
        loop.close()
    assert all(isinstance(got, UnavailableError) and got.message == "the gateway went away" for got in first), first
    assert after.text == "a" and after.finish_reason == "stop"
    assert fake.num_calls == 2


def test_a_window_goes_with_multiplex():
    with pytest.raises(ValueError, match="multiplex=True"):
        Client("127.0.0.1:1", window=8)
    with pytest.raises(ValueError, match="at least 1"):
        Client("127.0.0.1:1", multiplex=True, window=0)
