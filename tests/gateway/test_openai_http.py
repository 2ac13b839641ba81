"""The HTTP API's failure paths against fake routers, over real HTTP: a full queue is 429, no
router is 503, a missing or wrong bearer token is 401 (before any work), a streamed request
that fails before its first token is an HTTP error rather than a broken 200 stream, and a
client that drops a stream cancels its router call."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest

from gateway.harness import GatewayHarness, running_harness

pytestmark = pytest.mark.timeout(60)
MODEL = "fake-smollm2"
TOKEN = "test-token-for-http"
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def harness(tokenizer) -> Iterator[GatewayHarness]:
    with running_harness(tokenizer, with_http=True, token_check=lambda token: token == TOKEN) as running:
        yield running


def base_url(harness: GatewayHarness) -> str:
    return f"http://127.0.0.1:{harness.gateway.http.port}/v1"


def client(harness: GatewayHarness, token: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(harness), api_key=token, max_retries=0, timeout=TIMEOUT_S)


def test_bearer_token_is_checked_before_anything_else(harness) -> None:
    harness.script_all([11, 12, 2])
    with pytest.raises(openai.AuthenticationError) as denied:
        client(harness, "wrong").completions.create(model=MODEL, prompt="hello")
    assert denied.value.status_code == 401 and denied.value.code == "invalid_api_key"
    reply = httpx.post(f"{base_url(harness)}/chat/completions", json={"model": "nope"}, timeout=TIMEOUT_S)
    assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
    assert reply.json()["error"]["type"] == "authentication_error"
    assert harness.all_requests() == []
    assert httpx.get(f"{base_url(harness)[:-3]}/health", timeout=TIMEOUT_S).status_code == 200
    assert httpx.head(f"{base_url(harness)[:-3]}/health", timeout=TIMEOUT_S).status_code == 200
    done = client(harness).completions.create(model=MODEL, prompt="hello", max_tokens=5)
    assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens == 3


def test_full_queue_is_429_and_no_router_is_503(harness) -> None:
    for router in harness.routers:
        router.script([], fail_with=grpc.StatusCode.RESOURCE_EXHAUSTED)
    with pytest.raises(openai.RateLimitError) as full:
        client(harness).completions.create(model=MODEL, prompt="hello")
    assert full.value.status_code == 429 and full.value.response.headers["retry-after"] == "1"
    # Streamed too: the status line waits for the first token, so the error is a real 429.
    reply = httpx.post(f"{base_url(harness)}/completions", headers={"Authorization": f"Bearer {TOKEN}"},
                       json={"model": MODEL, "prompt": "hello", "stream": True}, timeout=TIMEOUT_S)
    assert reply.status_code == 429 and reply.json()["error"]["type"] == "rate_limit_error"
    assert reply.headers["retry-after"] == "1"
    for router in harness.routers:
        router.script([], fail_with=grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(openai.InternalServerError) as down:
        client(harness).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert down.value.status_code == 503 and down.value.response.headers["retry-after"] == "1"


def test_client_that_gives_up_cancels_the_router_call(harness) -> None:
    harness.script_all(list(range(100, 400)), delay_s=0.02)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url(harness)}/completions", headers={"Authorization": f"Bearer {TOKEN}"},
                   json={"model": MODEL, "prompt": "count", "max_tokens": 300}, timeout=0.5)
    deadline = time.monotonic() + TIMEOUT_S
    while not harness.all_cancelled() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(harness.all_cancelled()) == 1


def test_dropped_stream_cancels_the_router_call(harness) -> None:
    harness.script_all(list(range(100, 400)), delay_s=0.02)
    with httpx.stream("POST", f"{base_url(harness)}/completions", timeout=TIMEOUT_S,
                      headers={"Authorization": f"Bearer {TOKEN}"},
                      json={"model": MODEL, "prompt": "count", "stream": True, "max_tokens": 300}) as reply:
        assert reply.status_code == 200
        next(reply.iter_raw())
    deadline = time.monotonic() + TIMEOUT_S
    while not harness.all_cancelled() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(harness.all_cancelled()) == 1
