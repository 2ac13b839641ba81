"""Tool calling through a whole stack (`radixserve up`, TP=1, HTTP on) with real clients: the
official openai client and LangChain's ChatOpenAI. The model is tiny and random with SmolLM2's
tokenizer and chat template, which cannot render tools: the gateway renders them itself (the
Hermes layout). Every call that comes back must validate against its tool's schema: that comes
from the grammar, not from the model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI

from e2e.agent_model import AGENT_MAX_TOKENS, AGENT_MODEL
from e2e.stack import LaunchedStack

MODEL = AGENT_MODEL
TIMEOUT_S = 60.0
# Small schemas with bounded values, so a sampled call ends well within max_tokens.
LEVEL_SCHEMA = {
    "type": "object",
    "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 9},
                   "mode": {"enum": ["fast", "slow"]}},
    "required": ["level", "mode"], "additionalProperties": False,
}
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False,
}
SCHEMAS = {"set_level": LEVEL_SCHEMA, "get_weather": WEATHER_SCHEMA}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = AGENT_MAX_TOKENS


@pytest.fixture(scope="module")
def stack(agent_stack: LaunchedStack) -> LaunchedStack:
    return agent_stack


@pytest.fixture(scope="module")
def api(agent_api: openai.OpenAI) -> openai.OpenAI:
    return agent_api


def langchain_model(stack: LaunchedStack, **settings) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=f"{stack.http_base}/v1", api_key="unused", max_retries=0,
                      timeout=TIMEOUT_S, max_tokens=MAX_TOKENS, **settings)


def assert_valid(name: str, arguments: dict) -> None:
    jsonschema.validate(arguments, SCHEMAS[name])


@pytest.mark.timeout(180)
def test_langchain_bind_tools_invoke_and_stream_give_the_same_valid_call(stack) -> None:
    model = langchain_model(stack, temperature=0).bind_tools(TOOLS, tool_choice="required",
                                                             parallel_tool_calls=False)
    reply = model.invoke("What is the weather in Paris?")
    assert isinstance(reply, AIMessage) and len(reply.tool_calls) == 1, reply
    call = reply.tool_calls[0]
    assert call["id"] and call["name"] in SCHEMAS
    assert_valid(call["name"], call["args"])
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    # Streamed, the chunks add up to the same call (greedy: the same tokens).
    streamed = None
    for chunk in model.stream("What is the weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]


@pytest.mark.timeout(180)
def test_two_turns_with_a_tool_result_continue(stack) -> None:
    model = langchain_model(stack, temperature=0).bind_tools(TOOLS, tool_choice="get_weather",
                                                             parallel_tool_calls=False)
    first = model.invoke([HumanMessage("What is the weather in Paris?")])
    (call,) = first.tool_calls
    assert call["name"] == "get_weather"
    assert_valid("get_weather", call["args"])
    history = [HumanMessage("What is the weather in Paris?"), first,
               ToolMessage(json.dumps({"sky": "sunny", "degrees": 21}), tool_call_id=call["id"])]
    second = langchain_model(stack, temperature=0).bind_tools(TOOLS).invoke(history)
    assert isinstance(second, AIMessage)
    assert second.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    for later in second.tool_calls:  # auto: whatever call the model starts is valid too
        assert_valid(later["name"], later["args"])
    assert second.content or second.tool_calls


@pytest.mark.timeout(240)
def test_fifty_sampled_required_calls_all_validate(api) -> None:
    def ask(seed: int):
        return api.chat.completions.create(
            model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            temperature=1.0, seed=seed, max_tokens=MAX_TOKENS)

    with ThreadPoolExecutor(max_workers=10) as pool:
        replies = list(pool.map(ask, range(50)))
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert_valid(call.function.name, json.loads(call.function.arguments))
    assert len({r.choices[0].message.tool_calls[0].function.arguments for r in replies}) > 1  # sampled


@pytest.mark.timeout(180)
def test_openai_client_streamed_calls_reassemble(api) -> None:
    # One call: a random model allowed several keeps adding calls until max_tokens cuts it.
    fields = dict(model=MODEL, messages=CHAT, tools=TOOLS, temperature=0, max_tokens=MAX_TOKENS,
                  tool_choice={"type": "function", "function": {"name": "set_level"}}, parallel_tool_calls=False)
    whole = api.chat.completions.create(**fields).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    num_pieces = 0
    num_token_chunks = 0  # chunks that carried tokens (their logprobs say so)
    for chunk in api.chat.completions.create(**fields, stream=True, logprobs=True):
        choice = chunk.choices[0]
        delta = choice.delta
        finish = choice.finish_reason or finish
        num_token_chunks += bool(choice.logprobs and choice.logprobs.content)
        for part in delta.tool_calls or ():
            entry = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += part.id or ""
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
            num_pieces += bool(part.function.arguments)
    assert finish == "tool_calls"
    # The arguments arrive as they are generated, in many deltas, not one whole call at the end.
    # Where the stream itself came in few chunks (a reader behind the tokens gets several tokens
    # per chunk, by design), there is nothing to tell apart: then one piece is all there can be.
    assert num_pieces > 3 or num_token_chunks <= 4, (num_pieces, num_token_chunks)
    assert num_pieces >= 1
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole]
    for call in whole:
        assert call.function.name == "set_level"
        assert_valid("set_level", json.loads(call.function.arguments))


@pytest.mark.timeout(120)
def test_auto_calls_are_valid_whenever_the_model_starts_one(api) -> None:
    """Auto: text or calls, the model's choice; a call it starts is constrained to a valid one."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        replies = list(pool.map(lambda seed: api.chat.completions.create(
            model=MODEL, messages=CHAT, tools=TOOLS, parallel_tool_calls=False, temperature=1.0, seed=seed,
            max_tokens=16), range(16)))
    for reply in replies:
        choice = reply.choices[0]
        for call in choice.message.tool_calls or ():
            assert_valid(call.function.name, json.loads(call.function.arguments))
        if choice.finish_reason == "stop":
            assert "<tool_call>" not in (choice.message.content or "")
