"""A gpt-oss chat end to end: a tokenizer whose harmony markers are special tokens (SmolLM2's with
them added, and a chat template that writes harmony), fake routers answering scripted token ids
(on Generate calls, and on the Stream call's plain-token lane), the HTTP API through the openai
client and the gRPC API: reasoning, content and calls split out, whole and streamed alike, with
no marker in anything reported; a required call and a structured answer constrained after the
analysis."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from gateway.fake_router import FakeRouter
from gateway.fake_stream_router import StreamingFakeRouter
from gateway.harness import EOS_TOKEN_ID, GatewayHarness, start_harness, stop_harness
from gateway_service import harmony
from gateway_service.chat_format import ChatFormat
from gateway_service.tokenizer import Tokenizer
from harmony_chat import HARMONY_TEMPLATE
from radixserve.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(60)
MODEL = "fake-smollm2"
TIMEOUT_S = 10.0
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}}}
CHAT = [{"role": "user", "content": "Weather in Paris?"}]
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
ANSWER = ANALYSIS + "<|channel|>final<|message|>It is sunny in Paris.<|return|>"
CALL = ANALYSIS + ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                   '{"location":"Paris"}<|call|>')


@pytest.fixture(scope="module")
def harmony_tokenizer(smollm2_dir) -> Tokenizer:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    hf.add_special_tokens({"additional_special_tokens": list(harmony.MARKERS)})
    hf.chat_template = HARMONY_TEMPLATE
    return Tokenizer(hf)


@pytest.fixture(scope="module", params=[FakeRouter, StreamingFakeRouter], ids=["generate", "stream"])
def harness(harmony_tokenizer, request) -> Iterator[GatewayHarness]:
    running = start_harness(harmony_tokenizer, num_routers=1, with_http=True, router_class=request.param)
    try:
        yield running
    finally:
        stop_harness(running)


@pytest.fixture(scope="module")
def api(harness) -> Iterator[openai.OpenAI]:
    base = f"http://127.0.0.1:{harness.gateway.http.port}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=TIMEOUT_S) as client:
        yield client


def test_detection_links_the_two_parsers(harmony_tokenizer) -> None:
    for tools, reasoning in (("auto", "auto"), ("auto", "harmony"), ("harmony", "auto")):
        chat = ChatFormat.detect(harmony_tokenizer, tools, reasoning)
        assert (chat.tool_parser.name, chat.reasoning) == ("harmony", "harmony"), (tools, reasoning)
        assert chat.template_reads is not None and "enable_thinking" not in chat.template_reads
    for tools, reasoning in (("auto", "none"), ("auto", "think"), ("hermes", "auto")):
        with pytest.raises(ValueError, match="harmony is one format"):
            ChatFormat.detect(harmony_tokenizer, tools, reasoning)


def _say(harness: GatewayHarness, tokenizer: Tokenizer, text: str) -> None:
    token_ids = tokenizer.hf.encode(text, add_special_tokens=False)
    assert tokenizer.hf.convert_tokens_to_ids(harmony.MESSAGE) in token_ids  # markers are single tokens
    harness.script_all(token_ids + [EOS_TOKEN_ID])


def _no_markup(*texts: str | None) -> None:
    for text in texts:
        assert "<|" not in (text or ""), text


def test_the_format_is_found_from_the_template(harness) -> None:
    chat = harness.gateway.servicer.chat
    assert chat.reasoning == "harmony" and chat.tool_parser.name == "harmony" and chat.renders_tools


def test_analysis_is_reasoning_and_final_is_content(harness, api, harmony_tokenizer) -> None:
    _say(harness, harmony_tokenizer, ANSWER)
    choice = api.chat.completions.create(model=MODEL, messages=CHAT).choices[0]
    assert choice.message.content == "It is sunny in Paris." and choice.finish_reason == "stop"
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
    assert not choice.message.tool_calls
    prompt = harmony_tokenizer.decode_all(harness.all_requests()[-1].prompt_token_ids)
    assert prompt.endswith("<|start|>assistant")
    _say(harness, harmony_tokenizer, ANSWER)
    chunks = list(api.chat.completions.create(model=MODEL, messages=CHAT, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [(d.model_extra or {}).get("reasoning_content") for d in deltas]
    _no_markup(*(d.content for d in deltas), *reasoning)
    assert "".join(d.content or "" for d in deltas) == "It is sunny in Paris."
    assert "".join(r or "" for r in reasoning) == "The user wants the weather."
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_call_is_a_tool_call_whole_and_streamed(harness, api, harmony_tokenizer) -> None:
    _say(harness, harmony_tokenizer, CALL)
    choice = api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"location": "Paris"}
    sent = harness.all_requests()[-1]
    assert not sent.HasField("constraint")  # auto: parsed, not constrained
    assert "# Tools get_weather" in harmony_tokenizer.decode_all(sent.prompt_token_ids)
    _say(harness, harmony_tokenizer, CALL)
    chunks = list(api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    _no_markup(*(c.choices[0].delta.content for c in chunks if c.choices), *(d.function.arguments for d in deltas))
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"location": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_cut_by_max_tokens_inside_the_analysis(harness, api, harmony_tokenizer) -> None:
    _say(harness, harmony_tokenizer, ANSWER)
    choice = api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5).choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    reasoning = choice.message.model_extra["reasoning_content"]
    assert reasoning and "The user wants the weather.".startswith(reasoning)


def _accepts(tokenizer: Tokenizer, constraint, text: str) -> bool:
    from radixserve.grammar_compiler import GrammarCompiler

    compiler = GrammarCompiler.from_hf(tokenizer.hf, cache_size=2, vocab_size=len(tokenizer.hf))
    matcher = compiler.matcher(constraint)
    return bool(matcher.consume_tokens(tokenizer.hf.encode(text, add_special_tokens=False))) and matcher.is_accepting()


def test_a_required_call_is_constrained_after_the_analysis(harness, api, harmony_tokenizer) -> None:
    """`required` and a named function send harmony's call grammar, which lets the model think in
    its analysis channel first and accepts what it then writes (the end of turn is the EOS)."""
    call = CALL.replace('{"location":"Paris"}', '{"location": "Paris"}')
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        _say(harness, harmony_tokenizer, call)
        reply = api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], tool_choice=choice)
        (made,) = reply.choices[0].message.tool_calls
        assert made.function.name == "get_weather" and json.loads(made.function.arguments) == {"location": "Paris"}
        constraint = harness.sent_constraint()
        assert _accepts(harmony_tokenizer, constraint, call.removesuffix(harmony.CALL))
        assert not _accepts(harmony_tokenizer, constraint, ANSWER.removesuffix(harmony.RETURN))  # no answer
    with pytest.raises(openai.BadRequestError, match="enable_thinking"):  # the split cannot be turned off
        api.chat.completions.create(model=MODEL, messages=CHAT,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})


def test_response_format_binds_the_final_message(harness, api, harmony_tokenizer) -> None:
    schema = {"type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"]}
    answer = ANALYSIS + '<|channel|>final<|message|>{"sunny": true}'
    _say(harness, harmony_tokenizer, answer + harmony.RETURN)
    reply = api.chat.completions.create(model=MODEL, messages=CHAT, response_format={
        "type": "json_schema", "json_schema": {"name": "weather", "schema": schema}})
    message = reply.choices[0].message
    assert json.loads(message.content) == {"sunny": True}
    assert message.model_extra["reasoning_content"] == "The user wants the weather."
    constraint = harness.sent_constraint()
    assert constraint.kind.value == "llguidance" and _accepts(harmony_tokenizer, constraint, answer)
    assert not _accepts(harmony_tokenizer, constraint, '{"sunny": true}')  # no final message's header


def test_grpc_carries_the_same_split(harness, harmony_tokenizer) -> None:
    _say(harness, harmony_tokenizer, CALL)
    tool = pb.Tool(name="get_weather", parameters=json.dumps(WEATHER["function"]["parameters"]))
    chunks = list(harness.stub.Generate(pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="Weather in Paris?")], tools=[tool]), timeout=TIMEOUT_S))
    assert "".join(c.reasoning_text for c in chunks) == "The user wants the weather."
    assert "".join(c.text for c in chunks) == ""
    calls = [call for c in chunks for call in c.tool_calls]
    assert calls[0].name == "get_weather" and json.loads("".join(c.arguments for c in calls)) == {"location": "Paris"}
    assert chunks[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
