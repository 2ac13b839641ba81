"""The agent side of the HTTP API against fake routers that answer scripted token ids (on
Generate calls, and on the Stream call with bare tokens, which take the gateway's plain-token
lane), with the official openai client: tool calls parsed (whole and streamed), the tool grammar sent to the
router, tools and tool history in the prompt, the reasoning split, token-id prompts and echo,
/tokenize, /detokenize, /v1/models/{id}, and a 400 naming each field this server does not
support."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.fake_router import FakeRouter
from gateway.fake_stream_router import StreamingFakeRouter
from gateway.harness import EOS_TOKEN_ID, GatewayHarness, start_harness, stop_harness
from gateway_service.chat_format import ChatFormat

pytestmark = pytest.mark.timeout(60)
MODEL = "fake-smollm2"
TIMEOUT_S = 10.0
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CHAT = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module", params=[FakeRouter, StreamingFakeRouter], ids=["generate", "stream"])
def harness(tokenizer, request) -> Iterator[GatewayHarness]:
    """Routers answering on Generate calls, and on the Stream call with bare tokens, which the
    gateway hands to each choice by its plain-token lane (plain_lane.py) and splits there."""
    running = start_harness(tokenizer, num_routers=1, with_http=True, router_class=request.param)
    try:
        yield running
    finally:
        stop_harness(running)


@pytest.fixture(scope="module")
def api(harness) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{_base(harness)}/v1", api_key="unused", max_retries=0,
                       timeout=TIMEOUT_S) as client:
        yield client


def _base(harness: GatewayHarness) -> str:
    return f"http://127.0.0.1:{harness.gateway.http.port}"


def _say(harness: GatewayHarness, tokenizer, text: str) -> None:
    harness.script_all(tokenizer.encode_prompt(text) + [EOS_TOKEN_ID])


def _prompt(harness: GatewayHarness, tokenizer) -> str:
    return tokenizer.decode_all(harness.all_requests()[-1].prompt_token_ids)


def test_tool_call_is_parsed_and_the_grammar_goes_to_the_router(harness, api, tokenizer) -> None:
    _say(harness, tokenizer, CALL_TEXT)
    reply = api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    sent = harness.all_requests()[-1]
    assert "%json" in sent.constraint.grammar and '"const": "get_weather"' in sent.constraint.grammar
    # SmolLM2's template cannot render tools: they are in the system message, with the layout.
    prompt = _prompt(harness, tokenizer)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and "<tool_call>" in prompt


def test_streamed_call_reassembles_to_the_same_call(harness, api, tokenizer) -> None:
    _say(harness, tokenizer, "Checking. " + CALL_TEXT)
    chunks = list(api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert content == "Checking. "
    # The call streams as OpenAI's deltas: the first names it (id, name), the rest add arguments.
    assert len(deltas) > 1 and {d.index for d in deltas} == {0} and deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_malformed_call_is_content_and_tool_choice_none_renders_nothing(harness, api, tokenizer) -> None:
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
    _say(harness, tokenizer, broken)
    reply = api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER])
    assert reply.choices[0].message.content == broken and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"
    _say(harness, tokenizer, CALL_TEXT)
    reply = api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], tool_choice="none")
    assert reply.choices[0].message.content == CALL_TEXT and not reply.choices[0].message.tool_calls
    assert not harness.all_requests()[-1].HasField("constraint")
    assert "get_weather" not in _prompt(harness, tokenizer)


def test_required_and_named_choices_constrain_to_calls_only(harness, api, tokenizer) -> None:
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    _say(harness, tokenizer, CALL_TEXT)
    api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER, other], tool_choice="required",
                                parallel_tool_calls=False)
    grammar = harness.all_requests()[-1].constraint.grammar
    assert grammar.startswith('start: "<tool_call>" calls') and "get_time" in grammar and ")*" not in grammar
    api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER, other],
                                tool_choice={"type": "function", "function": {"name": "get_time"}})
    grammar = harness.all_requests()[-1].constraint.grammar
    assert grammar.startswith('start: "<tool_call>" calls') and "get_weather" not in grammar
    assert "get_weather" in _prompt(harness, tokenizer)  # all tools are still shown


def test_tool_history_is_rendered(harness, api, tokenizer) -> None:
    _say(harness, tokenizer, "It is sunny.")
    history = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
    ]
    reply = api.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER])
    assert reply.choices[0].message.content == "It is sunny." and reply.choices[0].finish_reason == "stop"
    prompt = _prompt(harness, tokenizer)
    assert CALL_TEXT in prompt and '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in prompt


def test_reasoning_split_whole_and_streamed(harness, api, tokenizer) -> None:
    servicer = harness.gateway.servicer
    plain = servicer.chat
    servicer.chat = ChatFormat.detect(tokenizer, "auto", "think")
    try:
        text = "<think>\nTwo and two.\n</think>\n\nFour."
        _say(harness, tokenizer, text)
        message = api.chat.completions.create(model=MODEL, messages=CHAT).choices[0].message
        assert message.content == "Four." and message.model_extra["reasoning_content"] == "\nTwo and two.\n"
        _say(harness, tokenizer, text)
        chunks = list(api.chat.completions.create(model=MODEL, messages=CHAT, stream=True))
        deltas = [c.choices[0].delta for c in chunks]
        assert "".join(d.content or "" for d in deltas) == "Four."
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "\nTwo and two.\n"
        # Off per request: the text is all content.
        _say(harness, tokenizer, text)
        message = api.chat.completions.create(model=MODEL, messages=CHAT,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}}
                                              ).choices[0].message
        assert message.content == text and "reasoning_content" not in (message.model_extra or {})
    finally:
        servicer.chat = plain


def test_token_id_prompts_and_echo(harness, api, tokenizer) -> None:
    ids = tokenizer.encode_prompt("Once upon a time")
    _say(harness, tokenizer, " there")
    done = api.completions.create(model=MODEL, prompt=ids, echo=True)
    assert list(harness.all_requests()[-1].prompt_token_ids) == ids
    assert done.choices[0].text == tokenizer.decode_all(ids) + " there"
    assert done.usage.prompt_tokens == len(ids)
    _say(harness, tokenizer, " there")
    done = api.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=4)
    assert [list(r.prompt_token_ids) for r in harness.all_requests()[-2:]] in ([ids, ids[:2]], [ids[:2], ids])
    assert [c.text for c in done.choices] == [" there", " there"]
    _say(harness, tokenizer, " there")
    chunks = list(api.completions.create(model=MODEL, prompt="Once upon a time", echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "Once upon a time there"
    with pytest.raises(openai.BadRequestError, match=r"prompt_token_ids\[0\] = 99999999"):
        api.completions.create(model=MODEL, prompt=[99999999])


def test_tokenize_detokenize_and_model_routes(harness, tokenizer) -> None:
    base = _base(harness)
    reply = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "hello world"}, timeout=TIMEOUT_S).json()
    assert reply["tokens"] == tokenizer.encode_prompt("hello world") and reply["count"] == len(reply["tokens"])
    assert reply["max_model_len"] == 512
    reply = httpx.post(f"{base}/tokenize", json={"messages": CHAT}, timeout=TIMEOUT_S).json()
    rendered = tokenizer.hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert reply["tokens"] == tokenizer.encode_rendered(rendered)
    no_prompt = httpx.post(f"{base}/tokenize", json={"messages": CHAT, "add_generation_prompt": False},
                           timeout=TIMEOUT_S).json()
    assert no_prompt["tokens"] == tokenizer.encode_rendered(
        tokenizer.hf.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False))
    with_tools = httpx.post(f"{base}/tokenize", json={"messages": CHAT, "tools": [WEATHER]}, timeout=TIMEOUT_S).json()
    assert "get_weather" in tokenizer.decode_all(with_tools["tokens"])
    reply = httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": reply["tokens"]}, timeout=TIMEOUT_S)
    assert reply.json() == {"prompt": rendered}
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [-1]}, timeout=TIMEOUT_S)
    assert bad.status_code == 400 and "token_ids[0]" in bad.json()["error"]["message"]
    wrong = httpx.post(f"{base}/tokenize", json={"model": "other", "prompt": "x"}, timeout=TIMEOUT_S)
    assert wrong.status_code == 404
    # vLLM's fields this server does not have are named, not dropped.
    for path, body, named in [("/tokenize", {"prompt": "x", "return_token_strs": True}, "return_token_strs"),
                              ("/tokenize", {"messages": [{"role": "user", "content": "x", "prefix": True}]},
                               "messages[0].prefix"),
                              ("/detokenize", {"tokens": [1], "skip_special_tokens": False}, "skip_special_tokens"),
                              ("/v1/embeddings", {"model": MODEL, "input": "x", "normalize": False}, "normalize")]:
        refused = httpx.post(f"{base}{path}", json=body, timeout=TIMEOUT_S)
        assert refused.status_code == 400 and f"{named} is not a field" in refused.json()["error"]["message"], path
    card = httpx.get(f"{base}/v1/models/{MODEL}", timeout=TIMEOUT_S)
    assert card.status_code == 200 and card.json()["id"] == MODEL and card.json()["object"] == "model"
    assert httpx.get(f"{base}/v1/models/nope", timeout=TIMEOUT_S).status_code == 404
    # HEAD answers as GET does, without the body (load balancers probe with it).
    for path, status in [("/v1/models", 200), (f"/v1/models/{MODEL}", 200), ("/v1/models/nope", 404)]:
        got, head = httpx.get(f"{base}{path}", timeout=TIMEOUT_S), httpx.head(f"{base}{path}", timeout=TIMEOUT_S)
        assert (head.status_code, head.content) == (status, b""), path
        assert head.headers["content-length"] == got.headers["content-length"], path


UNSUPPORTED = [
    ("chat", {"logit_bias": {"99999999": -100}}, "logit_bias: token id 99999999"),
    ("chat", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias: at most 300"),
    ("chat", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "end."}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"logit_bias": {"1": 100.5}}, "logit_bias[1]"),
    ("completions", {"logit_bias": {"one": 5}}, "logit_bias: key 'one'"),
    ("completions", {"echo": True, "logprobs": 1}, "echo with logprobs"),
    # An empty prompt of a batch is named (the lone prompt's message named neither).
    ("completions", {"prompt": ["a", ""]}, "prompt[1] is empty"),
    ("completions", {"prompt": [[1, 2], []]}, "prompt[1] is empty"),
    ("chat", {"tool_choice": "required"}, "no tools"),
    ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ("chat", {"tools": [WEATHER], "response_format": {"type": "json_object"}}, "either tools or"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools: "),
    ("chat", {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ("chat", {"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"continue_final_message": True}, "continue_final_message"),
    ("chat", {"structured_outputs": {"json": {"type": "object"}}}, "structured_outputs"),
    ("completions", {"min_tokens": 5}, "min_tokens"),
    ("completions", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("completions", {"skip_special_tokens": False}, "skip_special_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
    # Fields no API of ours defines: a typo, another server's extras (each a 200 that dropped it).
    ("chat", {"max_token": 3}, "max_token is not a field this server knows"),
    ("chat", {"frobnicate": 1}, "frobnicate is not a field"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort is not a field"),
    ("chat", {"regex": "[0-9]+"}, "regex is not a field"),
    ("completions", {"prediction": {"type": "content", "content": "x"}}, "prediction is not a field"),
    ("completions", {"parallel_tool_calls": False}, "parallel_tool_calls is not a field"),
    ("chat", {"messages": [{"role": "user", "content": "x", "prefix": True}]}, "messages[0].prefix is not a field"),
    ("chat", {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    # Found by sending them to a running stack: each was a 200 that dropped it.
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options needs stream: true"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options needs stream: true"),
    ("completions", {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs ("),
    ("completions", {"tools": [WEATHER]}, "tools ("),
    ("completions", {"tool_choice": "auto"}, "tool_choice ("),
    ("completions", {"max_completion_tokens": 3}, "max_completion_tokens (3)"),
    ("completions", {"top_logprobs": 2}, "top_logprobs (2)"),
    ("completions", {"add_special_tokens": False}, "add_special_tokens"),
    ("chat", {"add_special_tokens": True}, "add_special_tokens"),
    ("chat", {"prompt": "also this"}, "prompt ('also this')"),
    ("chat", {"suffix": "end."}, "suffix"),
    ("chat", {"messages": [{"role": "user", "content": "x", "function_call": {"name": "f"}}]},
     "messages[0].function_call"),
    ("chat", {"messages": [{"role": "assistant", "content": "", "refusal": "no"}, *CHAT]}, "messages[0].refusal"),
    ("chat", {"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]}, "messages[0].tool_call_id"),
]


@pytest.mark.parametrize("endpoint, fields, named", UNSUPPORTED)
def test_fields_that_would_be_ignored_are_a_400_naming_them(harness, endpoint, fields, named) -> None:
    body = {"model": MODEL, **({"messages": CHAT} if endpoint == "chat" else {"prompt": "hi"}), **fields}
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    before = len(harness.all_requests())
    reply = httpx.post(f"{_base(harness)}{path}", json=body, timeout=TIMEOUT_S)
    assert reply.status_code == 400, reply.text
    assert named in reply.json()["error"]["message"]
    assert len(harness.all_requests()) == before  # refused before any router saw it


def test_fields_asking_what_the_server_does_anyway_and_harmless_ones_pass(harness, tokenizer) -> None:
    _say(harness, tokenizer, "Fine.")
    # An echoed OpenAI message (its null fields, its annotations, a reasoning model's reasoning),
    # and participants' names as agent frameworks send them.
    messages = [{"role": "assistant", "content": "Hi.", "refusal": None, "audio": None, "function_call": None,
                 "annotations": [], "reasoning_content": "They greeted me."},
                {"role": "user", "content": "Weather in Paris?", "name": "alice"},
                {"role": "assistant", "content": "Which Paris?", "name": "research_agent"},
                {"role": "user", "content": "France.", "name": "alice"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "modalities": ["text"], "best_of": 1,
            "skip_special_tokens": True, "store": True, "metadata": {"a": "b"}, "service_tier": "auto",
            "prediction": {"type": "content", "content": "Fine."}, "prompt_cache_key": "agent-7",
            "safety_identifier": "u-1", "not_a_field": None, "add_special_tokens": False,
            "stream_options": None}
    reply = httpx.post(f"{_base(harness)}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "Fine."


def test_logit_bias_reaches_the_router_as_token_ids(harness) -> None:
    body = {"model": MODEL, "messages": CHAT, "logit_bias": {"5": 50, "17": -100}, "max_tokens": 2}
    reply = httpx.post(f"{_base(harness)}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    assert dict(harness.all_requests()[-1].sampling.logit_bias) == {5: 50.0, 17: -100.0}
