"""The OpenAI-compatible HTTP API on a real stack (TP=1, `radixserve up` with HTTP and metrics):
the official `openai` client (sync, async, streaming) against the gRPC API's output, usage,
stop strings, seeds, logprobs, n=2, error codes; SSE framing byte by byte with plain httpx;
and the gateway's and router's /metrics after a known set of requests, against GetStats."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import openai
import pytest

from radixserve_client import Client
from e2e.metrics_scrape import scrape, total
from e2e.stack import LaunchedStack, launch
from procs import ServiceProcesses
from radixserve.v1 import router_pb2, router_pb2_grpc

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
PROMPT = "The three primary colours are"
MAX_TOKENS = 12
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def stack(smollm2_dir):
    with ServiceProcesses() as procs:
        yield launch(procs, smollm2_dir, tp=1, with_http=True)


@pytest.fixture(scope="module")
def api(stack: LaunchedStack) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{stack.http_base}/v1", api_key="unused", max_retries=0,
                       timeout=TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_client(stack: LaunchedStack) -> Client:
    with Client(stack.gateway) as client:
        yield client


def router_stats(stack: LaunchedStack) -> router_pb2.GetStatsResponse:
    with grpc.insecure_channel(stack.router) as channel:
        return router_pb2_grpc.RouterServiceStub(channel).GetStats(
            router_pb2.GetStatsRequest(), timeout=5, metadata=stack.internal_metadata())


@pytest.mark.timeout(120)
def test_greedy_chat_and_completion_equal_the_grpc_api(api, grpc_client) -> None:
    chat = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    reference = grpc_client.generate(messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, timeout=TIMEOUT_S)
    assert chat.object == "chat.completion" and chat.model == MODEL
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == reference.text
    assert chat.choices[0].finish_reason == reference.finish_reason
    assert chat.usage.prompt_tokens == len(grpc_client.tokenize(messages=CHAT)) == reference.usage.prompt_tokens
    assert chat.usage.completion_tokens == len(reference.token_ids)
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    done = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    reference = grpc_client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, timeout=TIMEOUT_S)
    assert done.object == "text_completion"
    assert done.choices[0].text == reference.text
    assert done.usage.prompt_tokens == len(grpc_client.tokenize(PROMPT))
    assert done.usage.completion_tokens == len(reference.token_ids)

    # The same completion streamed: the pieces add up, usage comes last with no choices.
    chunks = list(api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reference.token_ids)
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == reference.finish_reason


@pytest.mark.timeout(120)
def test_async_client_streams_the_same_chat(api, stack) -> None:
    expected = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)

    async def stream() -> tuple[str, list]:
        async with openai.AsyncOpenAI(base_url=f"{stack.http_base}/v1", api_key="unused",
                                      max_retries=0, timeout=TIMEOUT_S) as client:
            chunks = [c async for c in await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True)]
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks

    text, chunks = asyncio.run(stream())
    assert text == expected.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == expected.choices[0].finish_reason
    assert len({c.id for c in chunks}) == 1


@pytest.mark.timeout(120)
def test_stop_strings_seeds_and_logprobs(api) -> None:
    full = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    stop = full[len(full) // 2:][:3]
    assert stop.strip(), f"pick another prompt: {full!r}"
    stopped = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert stopped.choices[0].text == full[:full.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    def sampled(seed: int) -> str:
        return api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=1.0,
                                           seed=seed).choices[0].message.content
    assert sampled(1234) == sampled(1234)

    chat = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for token in content:
        tops = [t.logprob for t in token.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert token.logprob == pytest.approx(tops[0])  # greedy takes the most likely token
        assert token.logprob <= 0 and bytes(token.bytes).decode() == token.token

    done = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    logprobs = done.choices[0].logprobs
    assert "".join(logprobs.tokens) == done.choices[0].text
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0


@pytest.mark.timeout(120)
def test_two_choices_share_the_prompt_cache(api, stack) -> None:
    # A prompt of several whole pages that no other test sends.
    prompt = "Here is a long list of animals: " + ", ".join(f"animal number {i}" for i in range(24))
    before = router_stats(stack)
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=4, temperature=1.0, seed=7, n=2)
    after = router_stats(stack)
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in chat.choices)
    prompt_len = chat.usage.prompt_tokens
    assert after.prompt_tokens - before.prompt_tokens == 2 * prompt_len  # usage counts it once
    # The second choice is served the first one's whole pages instead of recomputing them.
    page_size = 16
    assert after.cache_hit_tokens - before.cache_hit_tokens >= (prompt_len - 1) // page_size * page_size > 0


@pytest.mark.timeout(60)
def test_error_codes(api, stack) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model=MODEL, prompt=PROMPT, temperature=5)
    assert bad.value.status_code == 400 and "temperature" in bad.value.message
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as bad_seed:
        api.completions.create(model=MODEL, prompt=PROMPT, seed=-1)
    assert "seed" in bad_seed.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        api.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert missing.value.status_code == 404 and missing.value.code == "model_not_found"
    # A wrong JSON type is a 400 in OpenAI's error shape too, not FastAPI's 422.
    reply = httpx.post(f"{stack.http_base}/v1/completions", json={"model": MODEL, "prompt": 7}, timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert [m.id for m in api.models.list().data] == [MODEL]
    assert httpx.get(f"{stack.http_base}/health", timeout=10).status_code == 200
    # Unknown routes and methods, a string for a boolean, a lone surrogate: OpenAI's errors, no 500.
    for method, path, status in [("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405)]:
        reply = httpx.request(method, f"{stack.http_base}{path}", timeout=10)
        assert reply.status_code == status and set(reply.json()["error"]) == {"message", "type", "param", "code"}
    for body in [b'{"model": "%s", "prompt": "hi", "stream": "yes"}' % MODEL.encode(),
                 b'{"model": "%s", "prompt": "x\\ud800y"}' % MODEL.encode()]:
        reply = httpx.post(f"{stack.http_base}/v1/completions", content=body, timeout=10,
                           headers={"Content-Type": "application/json"})
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.timeout(60)
def test_user_is_an_end_user_id_and_the_request_id_is_echoed(stack) -> None:
    reply = httpx.post(f"{stack.http_base}/v1/completions", headers={"X-Request-Id": "e2e-req-1"}, timeout=TIMEOUT_S,
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "user": "josé-" + "u" * 200})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "e2e-req-1"


@pytest.mark.timeout(60)
def test_sse_framing_byte_level(stack) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{stack.http_base}/v1/chat/completions", json=body, timeout=TIMEOUT_S) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(reply.iter_raw())
    assert raw.endswith(b"\n\ndata: [DONE]\n\n") and raw.startswith(b"data: {")
    events = raw[:-2].split(b"\n\n")
    assert events[-1] == b"data: [DONE]"
    payloads = []
    for event in events[:-1]:
        assert event.startswith(b"data: ") and b"\n" not in event and b"\r" not in event
        payloads.append(json.loads(event[len(b"data: "):]))
    *choices, usage = payloads
    assert all(p["object"] == "chat.completion.chunk" and len(p["choices"]) == 1 for p in choices)
    assert choices[0]["choices"][0]["delta"]["role"] == "assistant"
    reasons = [p["choices"][0]["finish_reason"] for p in choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert all(p["usage"] is None for p in choices)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


@pytest.mark.timeout(120)
def test_metrics_match_requests_and_getstats(api, grpc_client, stack) -> None:
    gateway_before = scrape(stack.metrics_url("gateway"))
    router_before = scrape(stack.metrics_url("router"))
    usages = []
    for index in range(2):
        done = api.completions.create(model=MODEL, prompt=f"{PROMPT} {index}", max_tokens=3,
                                      temperature=0, extra_body={"ignore_eos": True})
        usages.append(done.usage)
    stopped = grpc_client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[],
                                   stop=[" "], timeout=TIMEOUT_S)
    # A stop string cancels the router's stream; wait until the router has let it go.
    stats = router_stats(stack)
    deadline = time.monotonic() + TIMEOUT_S
    while stats.num_running + stats.num_waiting and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = router_stats(stack)
    # The cancelled request's release still takes a step on the workers after it stops
    # running: scrape between two GetStats that agree, so both see the same steps.
    for _ in range(50):
        gateway = scrape(stack.metrics_url("gateway"))
        router = scrape(stack.metrics_url("router"))
        after = router_stats(stack)
        if after.num_steps == stats.num_steps:
            break
        stats = after
        time.sleep(0.05)

    def delta(after: dict, before: dict, name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    requests = "radixserve:requests_total"
    assert delta(gateway, gateway_before, requests, api="completions", status="ok", finish_reason="length") == 2
    assert delta(gateway, gateway_before, requests, api="grpc", status="ok", finish_reason="stop") == 1
    assert delta(gateway, gateway_before, requests) == 3
    prompt_tokens = sum(u.prompt_tokens for u in usages) + stopped.usage.prompt_tokens
    generated = sum(u.completion_tokens for u in usages) + stopped.usage.completion_tokens
    assert delta(gateway, gateway_before, "radixserve:prompt_tokens_total", model_name=MODEL) == prompt_tokens
    assert delta(gateway, gateway_before, "radixserve:generation_tokens_total") == generated
    assert delta(gateway, gateway_before, "radixserve:time_to_first_token_seconds_count") == 3
    assert delta(gateway, gateway_before, "radixserve:e2e_request_latency_seconds_count") == 3
    # A gap for every token after each request's first chunk (its first token, or a few).
    assert 0 < delta(gateway, gateway_before, "radixserve:inter_token_latency_seconds_count") <= generated - 3
    assert delta(gateway, gateway_before, "radixserve:inter_token_latency_seconds_sum") > 0
    # The router's counters are GetStats' numbers, and its cache hits are the gateway's cached tokens.
    assert total(router, "radixserve:prefix_cache_queries_total", model_name=MODEL) == stats.prompt_tokens
    assert total(router, "radixserve:prefix_cache_hits_total") == stats.cache_hit_tokens
    assert total(router, "radixserve:scheduler_steps_total") == stats.num_steps
    assert total(router, "radixserve:kv_pages_total") == stats.num_pages_total
    assert delta(router, router_before, "radixserve:prefix_cache_queries_total") == prompt_tokens
    assert (delta(router, router_before, "radixserve:prefix_cache_hits_total")
            == delta(gateway, gateway_before, "radixserve:cached_prompt_tokens_total"))
    assert delta(router, router_before, "radixserve:request_queue_time_seconds_count") == 3
    assert total(router, "radixserve:num_requests_running") == 0


@pytest.mark.timeout(120)
def test_structured_output_through_response_format_and_guided_extras(api) -> None:
    """`response_format` and the `guided_*` extras map onto the gRPC API's constraint."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    chat = api.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=32, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert chat.choices[0].finish_reason == "stop"
    answer = json.loads(chat.choices[0].message.content)
    assert set(answer) == {"city"} and isinstance(answer["city"], str)

    anything = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=48, temperature=0,
                                           response_format={"type": "json_object"})
    content = anything.choices[0].message.content
    assert content.startswith("{")  # the constraint holds even when max_tokens cuts it short
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)

    picked = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7,
                                    extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert picked.choices[0].text in {"yes", "no", "maybe"}

    # A constraint that forces tokens leaves fewer alternatives than asked: the answer lists the
    # allowed ones only (it was a 500: -inf is no JSON number).
    forced = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=5, extra_body={"guided_choice": ["Paris, France"]})
    assert forced.choices[0].message.content == "Paris, France"
    entries = forced.choices[0].logprobs.content
    assert entries and all(1 <= len(entry.top_logprobs) <= 5 for entry in entries)
    assert any(len(entry.top_logprobs) == 1 and entry.logprob == 0.0 for entry in entries)

    with pytest.raises(openai.BadRequestError):  # an invalid regex is the library's 400
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                               extra_body={"guided_regex": "(unclosed"})
    with pytest.raises(openai.BadRequestError):  # two constraints at once
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                               extra_body={"guided_regex": "a+", "guided_choice": ["a"]})
