"""Every HTTP failure is OpenAI's error JSON with the right status, never a 500: lone
surrogates, invalid UTF-8, deep nesting, wrong JSON types, unknown routes and methods, bodies
over --max-request-bytes; `user` is any Unicode within its bound and never our request id;
`X-Request-Id` is taken or made and echoed; every HTTP-layer rejection is counted in
requests_total, whose labelled series exist at 0."""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator

import httpx
import pytest

from gateway.harness import GatewayHarness, running_harness
from gateway_service.validation import RequestLimits
from radixserve.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(60)
MODEL = "fake-smollm2"
TOKEN = "test-token-for-errors"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TIMEOUT_S = 10.0
MAX_REQUEST_BYTES = RequestLimits().max_request_bytes


@pytest.fixture(scope="module")
def harness(tokenizer) -> Iterator[GatewayHarness]:
    with running_harness(tokenizer, with_http=True, token_check=lambda token: token == TOKEN) as running:
        yield running


def url(harness: GatewayHarness, path: str) -> str:
    return f"http://127.0.0.1:{harness.gateway.http.port}{path}"


def post(harness: GatewayHarness, path: str, content: bytes, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url(harness, path), content=content, timeout=TIMEOUT_S,
                      headers={**AUTH, "Content-Type": "application/json", **(headers or {})})


def assert_openai_error(reply: httpx.Response, status: int, *words: str) -> None:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error["message"]


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def encoded(body: dict) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: a lone surrogate stays a \ud800 escape


@pytest.mark.parametrize(("path", "body", "where"), [
    ("/v1/completions", {"model": MODEL, "prompt": "x\ud800y"}, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a\udfffb"}]},
     "messages[0].content"),
    ("/v1/chat/completions", chat(stop=["ok", "\ud83d"]), "stop[1]"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "user": "\udc00"}, "user"),
])
def test_lone_surrogates_are_400(harness, path, body, where) -> None:
    assert_openai_error(post(harness, path, encoded(body)), 400, where, "lone surrogate")


def test_malformed_bodies_are_400(harness) -> None:
    assert_openai_error(post(harness, "/v1/completions", b'{"model": "x", "prompt": "\xff\xfe"}'), 400, "UTF-8")
    assert_openai_error(post(harness, "/v1/completions", b'{"model": '), 400, "not valid JSON")
    deep = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert_openai_error(post(harness, "/v1/completions", deep), 400, "nested")
    assert_openai_error(post(harness, "/v1/completions", b"[1, 2]"), 400)
    # Without a valid token the body is never parsed: 401, not 400.
    assert_openai_error(post(harness, "/v1/completions", b'{"model": ', {"Authorization": "Bearer wrong"}), 401)


@pytest.mark.parametrize("fields", [{"stream": "yes"}, {"logprobs": "yes"}, {"n": "2"}, {"n": True},
                                    {"temperature": "0.5"}, {"max_tokens": 1.5}, {"stop": 7}])
def test_wrong_types_are_400(harness, fields) -> None:
    (name,) = fields
    assert_openai_error(post(harness, "/v1/chat/completions", encoded(chat(**fields))), 400, name)


def test_routes_and_methods_answer_openai_errors(harness) -> None:
    assert_openai_error(httpx.get(url(harness, "/v1/nothing-here"), headers=AUTH, timeout=TIMEOUT_S), 404,
                        "/v1/nothing-here")
    assert_openai_error(httpx.get(url(harness, "/v1/chat/completions"), headers=AUTH, timeout=TIMEOUT_S),
                        405, "GET")
    assert_openai_error(post(harness, "/v1/chat/completions", encoded(chat(model="other"))), 404, "other")


def test_bodies_over_the_limit_are_413(harness) -> None:
    too_big = b"x" * (MAX_REQUEST_BYTES + 1)
    assert_openai_error(post(harness, "/v1/completions", too_big), 413, "limit")

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while it streams in
        for _ in range(MAX_REQUEST_BYTES // 65536 + 2):
            yield b" " * 65536

    assert_openai_error(post(harness, "/v1/completions", chunks()), 413, "limit")


def test_a_compressed_body_is_415_naming_its_encoding(harness) -> None:
    body = encoded({"model": MODEL, "prompt": "hi"})
    for encoding in ("gzip", "br", "deflate, gzip"):
        reply = post(harness, "/v1/completions", gzip.compress(body), {"Content-Encoding": encoding})
        assert_openai_error(reply, 415, f"Content-Encoding {encoding!r} is not supported")
    harness.script_all([11, 12, 2])
    assert post(harness, "/v1/completions", body, {"Content-Encoding": "identity"}).status_code == 200


def test_user_is_any_unicode_within_its_bound_and_not_the_request_id(harness) -> None:
    harness.script_all([11, 12, 2])
    for user in ("josé", "u" * 200, "用户-😀"):
        reply = post(harness, "/v1/completions", encoded({"model": MODEL, "prompt": "hi", "user": user}))
        assert reply.status_code == 200, reply.text
    assert not any(user in r.request_id for r in harness.all_requests() for user in ("jos", "uuu"))
    too_long = encoded({"model": MODEL, "prompt": "hi", "user": "u" * (RequestLimits().max_user_chars + 1)})
    assert_openai_error(post(harness, "/v1/completions", too_long), 400, "user")


def test_request_id_is_taken_or_made_and_echoed(harness, caplog) -> None:
    harness.script_all([11, 12, 2])
    caplog.set_level(logging.INFO, logger="radixserve.access")
    reply = post(harness, "/v1/completions", encoded({"model": MODEL, "prompt": "hi"}), {"X-Request-Id": "abc-123"})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "abc-123"
    assert any(r.request_id.startswith("abc-123-") for r in harness.all_requests())
    # The choices of one request share its id, and each gets its own router id.
    for router in harness.routers:
        router.state.requests.clear()
    two = post(harness, "/v1/completions", encoded({"model": MODEL, "prompt": "hi", "n": 2}), {"X-Request-Id": "two"})
    assert two.status_code == 200 and two.headers["x-request-id"] == "two"
    ids = [r.request_id for r in harness.all_requests()]
    assert len(ids) == 2 and len(set(ids)) == 2 and all(i.startswith("two-") for i in ids)
    made = post(harness, "/v1/completions", encoded({"model": MODEL, "prompt": "hi"}), {"X-Request-Id": "é".encode("latin-1") * 3})
    assert made.status_code == 200 and len(made.headers["x-request-id"]) == 32
    too_long = post(harness, "/v1/completions", encoded({"model": MODEL, "prompt": "hi"}), {"X-Request-Id": "x" * 500})
    assert too_long.headers["x-request-id"] != "x" * 500
    denied = httpx.get(url(harness, "/v1/models"), headers={"X-Request-Id": "no-token"}, timeout=TIMEOUT_S)
    assert denied.status_code == 401 and denied.headers["x-request-id"] == "no-token"
    # gRPC: from metadata, echoed in the initial metadata.
    responses = harness.stub.Generate(pb.GenerateRequest(prompt="hi"), metadata=(("x-request-id", "grpc-7"),), timeout=TIMEOUT_S)
    list(responses)
    assert dict(responses.initial_metadata())["x-request-id"] == "grpc-7"
    lines = [r for r in caplog.records if r.name == "radixserve.access"]
    ok = next(r for r in lines if r.request_id == "abc-123")
    assert (ok.route, ok.status, ok.finish_reason, ok.output_tokens) == ("/v1/completions", "ok", "stop", 3)
    assert ok.prompt_tokens > 0 and ok.ttft_s is not None and ok.total_s >= ok.ttft_s
    assert next(r for r in lines if r.request_id == "grpc-7").status == "ok"
    assert next(r for r in lines if r.request_id == "no-token").status == "UNAUTHENTICATED"


def test_rejections_are_counted_and_series_exist_at_zero(harness) -> None:
    registry = harness.gateway.servicer.metrics.registry

    def count(api: str, status: str) -> float:
        return registry.get_sample_value("radixserve:requests_total", {
            "model_name": MODEL, "api": api, "status": status, "finish_reason": ""}) or 0.0

    post(harness, "/v1/completions", encoded({"model": MODEL, "prompt": "hi"}))  # the model is known
    assert registry.get_sample_value("radixserve:requests_total", {
        "model_name": MODEL, "api": "grpc", "status": "DEADLINE_EXCEEDED", "finish_reason": ""}) is not None
    before = {key: count(*key) for key in [("chat_completions", "UNAUTHENTICATED"), ("completions", "NOT_FOUND"),
                                           ("chat_completions", "INVALID_ARGUMENT"),
                                           ("completions", "RESOURCE_EXHAUSTED")]}
    post(harness, "/v1/chat/completions", encoded(chat()), {"Authorization": "Bearer wrong"})
    post(harness, "/v1/completions", encoded({"model": "other", "prompt": "hi"}))
    post(harness, "/v1/chat/completions", encoded(chat(stream="yes")))
    post(harness, "/v1/completions", b"x" * (MAX_REQUEST_BYTES + 1))
    for key, value in before.items():
        assert count(*key) == value + 1, key
