"""Two of the newer call layouts end to end through the HTTP API and the openai client: GLM-4.5's
tagged arguments (after its `<think>` block) and Kimi-K2's JSON arguments, each with a chat
template holding only its family's cue and a tokenizer (SmolLM2's) where the family's tags are
special tokens, so they reach the parser only if the gateway keeps them; fake routers answer
scripted token ids (on Generate calls, and on the Stream call's plain-token lane). Calls come out
the same whole and streamed, with no tag in anything reported; every `tool_choice` but none sends
the family's grammar, which accepts what the model wrote (its tags as their special tokens)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from gateway.fake_router import FakeRouter
from gateway.fake_stream_router import StreamingFakeRouter
from gateway.harness import EOS_TOKEN_ID, GatewayHarness, start_harness, stop_harness
from gateway_service.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(60)
MODEL = "fake-smollm2"
TIMEOUT_S = 10.0
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}}}
CHAT = [{"role": "user", "content": "Weather in Paris?"}]


@dataclass(frozen=True)
class Family:
    template: str
    tags: tuple[str, ...]  # special tokens in this tokenizer
    output: str  # what the model writes: a call after some reasoning or content
    content: str
    reasoning: str | None


FAMILIES = {
    "glm45": Family(
        template=("{%- if tools %}<|system|>\n# Tools{% for tool in tools %} {{ tool.function.name }}{% endfor %}\n"
                  "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
                  "</tool_call>{% endif %}"
                  "{%- for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' %}\n<think></think>{% endif %}"
                  "\n{{ m.content }}{%- endfor %}"
                  "{%- if add_generation_prompt %}<|assistant|>{% endif %}"),
        tags=("<|system|>", "<|user|>", "<|assistant|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
              "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
        output=("\n<think>The user wants the weather.</think>\nLet me look.\n<tool_call>get_weather\n"
                "<arg_key>location</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),
        content="Let me look.\n", reasoning="The user wants the weather."),
    "kimi_k2": Family(
        template=("{%- if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}"
                  "{%- for m in messages %}<|im_user|>{{ m.role }}<|im_middle|>{{ m.content }}"
                  "{%- if m.tool_calls %}<|tool_calls_section_begin|>{% endif %}<|im_end|>{%- endfor %}"
                  "{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"),
        tags=("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
              "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
              "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
        output=("I will check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"location": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'),
        content="I will check.", reasoning=None),
}


ROUTERS = {"generate": FakeRouter, "stream": StreamingFakeRouter}


@pytest.fixture(scope="module", params=[(name, kind) for name in FAMILIES for kind in ROUTERS],
                ids=lambda param: "-".join(param))
def family(smollm2_dir, request) -> Iterator[tuple[str, Family, Tokenizer, GatewayHarness]]:
    from transformers import AutoTokenizer

    name, kind = request.param
    spec = FAMILIES[name]
    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    hf.add_special_tokens({"additional_special_tokens": list(spec.tags)})
    hf.chat_template = spec.template
    tokenizer = Tokenizer(hf)
    running = start_harness(tokenizer, num_routers=1, with_http=True, router_class=ROUTERS[kind])
    try:
        yield name, spec, tokenizer, running
    finally:
        stop_harness(running)


@pytest.fixture(scope="module")
def api(family) -> Iterator[openai.OpenAI]:
    base = f"http://127.0.0.1:{family[3].gateway.http.port}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=TIMEOUT_S) as client:
        yield client


def _say(family) -> None:
    _, spec, tokenizer, harness = family
    token_ids = tokenizer.hf.encode(spec.output, add_special_tokens=False)
    assert tokenizer.hf.convert_tokens_to_ids(spec.tags[-1]) in token_ids  # the tags are single tokens
    harness.script_all(token_ids + [EOS_TOKEN_ID])


def _tool_grammar(harness: GatewayHarness, spec: Family) -> str:
    """The tools' grammar the last request carried: behind the reasoning block (llguidance's own
    grammar JSON, the tools' grammar second) for a family that thinks, else as it is."""
    constraint = harness.sent_constraint()
    if spec.reasoning is None:
        return constraint.text
    grammars = json.loads(constraint.text)["grammars"]
    assert "<think>" in grammars[0]["lark_grammar"] or "<[" in grammars[0]["lark_grammar"]
    return grammars[1]["lark_grammar"]


def _no_tags(*texts: str | None) -> None:
    for text in texts:
        assert "<" not in (text or ""), text


def test_the_family_is_found_from_the_template(family) -> None:
    name, spec, _, harness = family
    chat = harness.gateway.servicer.chat
    assert chat.tool_parser.name == name and chat.renders_tools
    assert chat.reasoning == ("think" if spec.reasoning else None)


def test_a_call_whole_and_streamed(family, api) -> None:
    _, spec, tokenizer, harness = family
    _say(family)
    choice = api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == spec.content
    assert (choice.message.model_extra or {}).get("reasoning_content") == spec.reasoning
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"location": "Paris"}
    assert _tool_grammar(harness, spec).startswith("start: TEXT")  # auto: text, or text then valid calls
    assert "get_weather" in tokenizer.decode_all(harness.all_requests()[-1].prompt_token_ids)
    _say(family)
    chunks = list(api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for delta in deltas for call in delta.tool_calls or ()]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    _no_tags(*(d.content for d in deltas), reasoning, *(c.function.arguments for c in calls))
    assert "".join(d.content or "" for d in deltas) == spec.content and reasoning == (spec.reasoning or "")
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"location": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_a_call_the_text_is_content(family, api) -> None:
    _, spec, tokenizer, harness = family
    harness.script_all(tokenizer.hf.encode("It is sunny in Paris.", add_special_tokens=False) + [EOS_TOKEN_ID])
    choice = api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER]).choices[0]
    assert choice.message.content == "It is sunny in Paris." and choice.finish_reason == "stop"
    assert not choice.message.tool_calls


def test_a_required_call_is_constrained_by_the_familys_grammar(family, api, smollm2_dir) -> None:
    """`required` and a named function send a grammar of calls only; what the model writes under it
    (here the family's own rendering of the call) is accepted token by token and read back."""
    from gateway_service.tool_parsers import PARSERS
    from radixserve.grammar_compiler import GrammarCompiler

    name, spec, tokenizer, harness = family
    written = PARSERS[name]().render_calls([("get_weather", {"location": "Paris"})])
    token_ids = tokenizer.hf.encode(written, add_special_tokens=False)
    compiler = GrammarCompiler.from_hf(tokenizer.hf, cache_size=4, vocab_size=len(tokenizer.hf))
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        harness.script_all(token_ids + [EOS_TOKEN_ID])
        reply = api.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER], tool_choice=choice)
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"location": "Paris"}
        assert reply.choices[0].finish_reason == "tool_calls" and not reply.choices[0].message.content
        assert not _tool_grammar(harness, spec).startswith("start: TEXT")  # calls only
        matcher = compiler.matcher(harness.sent_constraint())
        assert matcher.consume_tokens(token_ids) and matcher.is_accepting()
        assert not compiler.matcher(harness.sent_constraint()).consume_tokens(
            tokenizer.hf.encode("It is sunny.", add_special_tokens=False))
