"""Coalescing: updates of a request that wait for the gateway together (a gateway behind the
router's steps) go out as one chunk (gRPC message, SSE event), and the client sees exactly what
one chunk per token gives: tokens, text, logprobs, finish reason and usage, also when a stop
string ends the output inside such a group. The reference is the same request streamed one
update at a time, and `OutputAssembler` fed one token at a time. Without logprobs the router
sends most tokens bare (router.proto), so the groups mix bare tokens and updates."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from gateway.fake_stream_router import StreamingFakeRouter
from gateway.harness import GatewayHarness, running_harness, stream_summary
from gateway_service.output import OutputAssembler
from radixserve.v1 import generation_pb2

pytestmark = pytest.mark.timeout(60)
TEXT = "Coalesced tokens read the same: naïve café 😀 世界. The end is here STOP and never this."
STOP = "STOP"
GROUP = 5
# Slow enough that the gateway keeps up: one chunk per token for the reference.
ONE_BY_ONE_DELAY_S = 0.01
TOP = 2


@pytest.fixture(scope="module")
def harness(tokenizer) -> Iterator[GatewayHarness]:
    with running_harness(tokenizer, num_routers=1, with_http=True, router_class=StreamingFakeRouter) as running:
        yield running


@pytest.fixture(scope="module")
def token_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode_prompt(TEXT, add_special_tokens=False)
    # The stop string must end inside a group, with tokens of the group after it.
    stop_at = next(i for i in range(len(ids)) if STOP in tokenizer.decode(ids[:i + 1]))
    assert stop_at % GROUP != GROUP - 1, "pick TEXT or GROUP so that STOP ends inside a group"
    return ids


def grpc_chunks(harness: GatewayHarness, stop: list[str], logprobs: bool) -> list[generation_pb2.GenerateResponse]:
    request = generation_pb2.GenerateRequest(prompt="hello", max_tokens=200, stop=stop, logprobs=logprobs,
                                             top_logprobs=TOP if logprobs else 0, ignore_eos=True)
    return list(harness.stub.Generate(request, timeout=30))


def http_events(harness: GatewayHarness, stop: list[str], logprobs: bool) -> list[dict]:
    body = {"model": "fake-smollm2", "prompt": "hello", "max_tokens": 200, "stop": stop,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if logprobs:
        body["logprobs"] = TOP
    url = f"http://127.0.0.1:{harness.gateway.http.port}/v1/completions"
    events = []
    with httpx.stream("POST", url, json=body, timeout=30) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def http_summary(events: list[dict]) -> dict:
    choices = [event["choices"][0] for event in events if event["choices"]]
    logprobs = [choice["logprobs"] or {} for choice in choices]
    return {
        "text": "".join(choice["text"] for choice in choices),
        "tokens": [t for lp in logprobs for t in lp.get("tokens", [])],
        "token_logprobs": [t for lp in logprobs for t in lp.get("token_logprobs", [])],
        "top_logprobs": [t for lp in logprobs for t in lp.get("top_logprobs", [])],
        "finish_reason": choices[-1]["finish_reason"],
        "usage": events[-1]["usage"],
    }


@pytest.mark.parametrize("logprobs", [True, False], ids=["logprobs", "bare-tokens"])
@pytest.mark.parametrize("stop", [[STOP], []], ids=["stop-string", "length"])
def test_grpc_coalesced_stream_equals_one_token_at_a_time(harness, tokenizer, token_ids, stop, logprobs) -> None:
    harness.script_all(token_ids, chunk_size=1, delay_s=ONE_BY_ONE_DELAY_S)
    one_by_one = grpc_chunks(harness, stop, logprobs)
    harness.script_all(token_ids, chunk_size=GROUP)
    coalesced = grpc_chunks(harness, stop, logprobs)
    assert stream_summary(coalesced) == stream_summary(one_by_one)
    assert bool(stream_summary(coalesced)["logprobs"]) == logprobs
    # Without logprobs most tokens went bare: the gateway reads them as it reads updates.
    assert (harness.routers[0].state.num_bare_tokens > len(token_ids) // 2) != logprobs
    # The groups did go out as one chunk each (the reference had a chunk per token or nearly).
    assert len(coalesced) <= len(token_ids) // GROUP + 2 < len(one_by_one)
    # And both are what the assembler gives fed one token at a time.
    assembler = OutputAssembler(tokenizer, stop, prompt_len=1)
    text = ""
    for token_id in token_ids:
        chunk = assembler.add([token_id])
        text += chunk.text if chunk is not None else ""
        if assembler.finished:
            break
    if not assembler.finished:
        text += assembler.add([], finish_reason=generation_pb2.FINISH_REASON_LENGTH).text
    assert stream_summary(coalesced)["text"] == text
    if stop:
        assert text == TEXT[:TEXT.index(STOP)]
        assert stream_summary(coalesced)["finish_reason"] == generation_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize("logprobs", [True, False], ids=["logprobs", "bare-tokens"])
@pytest.mark.parametrize("stop", [[STOP], []], ids=["stop-string", "length"])
def test_http_coalesced_stream_equals_one_token_at_a_time(harness, token_ids, stop, logprobs) -> None:
    harness.script_all(token_ids, chunk_size=1, delay_s=ONE_BY_ONE_DELAY_S)
    one_by_one = http_events(harness, stop, logprobs)
    harness.script_all(token_ids, chunk_size=GROUP)
    coalesced = http_events(harness, stop, logprobs)
    assert (harness.routers[0].state.num_bare_tokens > len(token_ids) // 2) != logprobs
    assert http_summary(coalesced) == http_summary(one_by_one)
    assert len(coalesced) < len(one_by_one)
    expected_text = TEXT[:TEXT.index(STOP)] if stop else TEXT
    assert http_summary(coalesced)["text"] == expected_text
    assert http_summary(coalesced)["finish_reason"] == ("stop" if stop else "length")
