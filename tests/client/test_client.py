"""The blocking and asyncio clients and the CLI: results, streaming, typed errors."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from radixserve_client import (
    AsyncClient,
    Client,
    DeadlineExceededError,
    InvalidArgumentError,
    RadixServeError,
    ResourceExhaustedError,
    UnavailableError,
)
from radixserve_client.cli import main as cli_main
from gateway.harness import CONTEXT_LEN, EOS_TOKEN_ID
from radixserve.v1.generation_pb2 import ChatMessage

pytestmark = pytest.mark.timeout(60)

TEXT = "Streaming 😀 text, 世界!"


def test_generate_returns_the_whole_result(harness, client_tokenizer):
    ids = client_tokenizer.encode_prompt(TEXT) + [EOS_TOKEN_ID]
    harness.script_all(ids)
    with Client(harness.address) as client:
        result = client.generate(prompt="hi", max_tokens=50, temperature=0, logprobs=True)
    assert result.text == TEXT
    assert result.token_ids == ids
    assert result.finish_reason == "stop"
    assert result.usage.completion_tokens == len(ids)
    assert result.usage.prompt_tokens == len(client_tokenizer.encode_prompt("hi"))
    assert [lp.token_id for lp in result.logprobs] == ids
    (sent,) = harness.all_requests()
    assert sent.sampling.temperature == 0 and sent.max_tokens == 50


def test_stream_yields_chunks_whose_text_joins_to_the_result(harness, client_tokenizer):
    ids = client_tokenizer.encode_prompt(TEXT)
    harness.script_all(ids)
    with Client(harness.address) as client:
        chunks = list(client.stream(messages=[{"role": "user", "content": "hi"}], max_tokens=len(ids)))
    assert len(chunks) > 1
    assert "".join(c.text for c in chunks) == TEXT
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage is not None
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_errors_are_typed_with_code_and_message(harness):
    with Client(harness.address) as client:
        with pytest.raises(InvalidArgumentError) as err:
            client.generate(prompt="hi", temperature=3.0)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.temperature" in err.value.message
        assert isinstance(err.value, RadixServeError)
        with pytest.raises(InvalidArgumentError):
            client.tokenize()
        harness.script_all([EOS_TOKEN_ID], fail_with=grpc.StatusCode.UNAVAILABLE)
        with pytest.raises(UnavailableError):
            client.generate(prompt="hi")
        harness.script_all([EOS_TOKEN_ID], fail_with=grpc.StatusCode.RESOURCE_EXHAUSTED)
        with pytest.raises(ResourceExhaustedError):
            client.generate(prompt="hi")
        harness.script_all([5] * 100, delay_s=0.05)
        with pytest.raises(DeadlineExceededError):
            client.generate(prompt="hi", max_tokens=100, timeout=0.3)


def test_unreachable_gateway_is_unavailable():
    with Client("127.0.0.1:1") as client:
        with pytest.raises(UnavailableError):
            client.model_info(timeout=2)


def test_tokenize_and_model_info(harness, client_tokenizer):
    with Client(harness.address) as client:
        assert client.tokenize(prompt="hello world") == client_tokenizer.encode_prompt("hello world")
        info = client.model_info()
    assert info.context_len == CONTEXT_LEN and info.model_name == "fake-smollm2"


def test_async_client_generate_stream_and_errors(harness, client_tokenizer):
    ids = client_tokenizer.encode_prompt(TEXT) + [EOS_TOKEN_ID]
    harness.script_all(ids)

    async def scenario():
        async with AsyncClient(harness.address) as client:
            result = await client.generate(prompt="hi")
            chunks = [c async for c in client.stream(prompt="hi")]
            with pytest.raises(InvalidArgumentError) as err:
                await client.generate(prompt="hi", max_tokens=0)
            info = await client.model_info()
            return result, chunks, err.value, info

    result, chunks, error, info = asyncio.run(scenario())
    assert result.text == TEXT and result.finish_reason == "stop"
    assert "".join(c.text for c in chunks) == TEXT
    assert "max_tokens" in error.message
    assert info.page_size == 16


def test_cli_generate_and_chat_stream_to_stdout(harness, client_tokenizer, capsys):
    harness.script_all(client_tokenizer.encode_prompt(TEXT) + [EOS_TOKEN_ID])
    assert cli_main(["generate", "hello", "--address", harness.address, "--max-tokens", "20",
                     "--temperature", "0", "--usage"]) == 0
    out, err = capsys.readouterr()
    assert out == TEXT + "\n"
    assert "finish: stop" in err
    assert cli_main(["chat", "--address", harness.address, "--system", "Be brief.",
                     "--message", "user:Hi", "--message", "assistant:Hello!", "Tell me more"]) == 0
    assert capsys.readouterr().out == TEXT + "\n"
    turns = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi"),
             ChatMessage(role="assistant", content="Hello!"), ChatMessage(role="user", content="Tell me more")]
    # The fake routers sit on random ports, so which one got the chat varies from run to run.
    sent = [list(r.prompt_token_ids) for r in harness.all_requests()]
    assert client_tokenizer.encode_chat(turns) in sent
    assert cli_main(["generate", "hello", "--address", harness.address, "--top-p", "0"]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


MANY = [
    {"prompt": "one", "max_tokens": 5},
    {"messages": [{"role": "user", "content": "two"}], "max_tokens": 50, "logprobs": True},
    {"prompt": "three", "max_tokens": 50, "stop": ["text"]},
    {"prompt": "bad", "temperature": 3.0},
    {"prompt": "five", "max_tokens": 2, "ignore_eos": True},
]


def test_generate_many_gives_each_request_what_generate_gives(harness, client_tokenizer):
    """One GenerateMany call, two requests open at a time: every result equals its own
    `generate` call's; a failed request is its typed error, in its place."""
    ids = client_tokenizer.encode_prompt(TEXT) + [EOS_TOKEN_ID]
    harness.script_all(ids)
    with Client(harness.address) as client:
        results = client.generate_many(MANY, window=2, return_exceptions=True)
        alone = []
        for options in MANY:
            try:
                alone.append(client.generate(**options))
            except RadixServeError as exc:
                alone.append(exc)
        with pytest.raises(InvalidArgumentError, match="sampling.temperature"):
            client.generate_many(MANY)
    assert len(results) == len(MANY)
    for got, expected in zip(results, alone):
        if isinstance(expected, RadixServeError):
            assert type(got) is type(expected) and got.message == expected.message
        else:
            assert got == expected
    assert results[0].usage.completion_tokens == 5 and results[2].finish_reason == "stop"
    assert results[2].text == "Streaming 😀 " and results[4].token_ids == ids[:2]


def test_async_generate_many_matches_generate(harness, client_tokenizer):
    ids = client_tokenizer.encode_prompt(TEXT) + [EOS_TOKEN_ID]
    harness.script_all(ids)
    requests = [options for options in MANY if options.get("prompt") != "bad"]

    async def scenario():
        async with AsyncClient(harness.address) as client:
            many = await client.generate_many(requests * 3, window=4)
            alone = [await client.generate(**options) for options in requests]
            empty = await client.generate_many([])
            return many, alone, empty

    many, alone, empty = asyncio.run(scenario())
    assert many == alone * 3 and empty == []
