"""The agent fields on the gRPC API (the same servicer code as HTTP) against fake routers: tools
and a parsed call with FINISH_REASON_TOOL_CALLS, token-id prompts, Detokenize, and
INVALID_ARGUMENT naming the field for a bad tool or tool choice."""

from __future__ import annotations

import json

import grpc
import pytest

from gateway.harness import EOS_TOKEN_ID
from radixserve.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(60)
TOOL = pb.Tool(name="get_time", description="the time in a zone",
               parameters=json.dumps({"type": "object", "properties": {"zone": {"type": "string"}}}))
CHAT = [pb.ChatMessage(role="user", content="What time is it in Paris?")]
TIMEOUT_S = 10


def test_generate_with_tools_returns_the_call(harness, tokenizer) -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    harness.script_all(tokenizer.encode_prompt(text) + [EOS_TOKEN_ID])
    chunks = list(harness.stub.Generate(pb.GenerateRequest(
        messages=CHAT, tools=[TOOL], tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED),
        parallel_tool_calls=False), timeout=TIMEOUT_S))
    assert "".join(c.text for c in chunks) == ""
    # Streamed as deltas sharing the call's index: the first has id and name, the rest arguments.
    calls = [call for c in chunks for call in c.tool_calls]
    assert {c.index for c in calls} == {0} and calls[0].name == "get_time" and calls[0].id.startswith("call_")
    assert all(not c.id and not c.name for c in calls[1:])
    assert json.loads("".join(c.arguments for c in calls)) == {"zone": "CET"}
    assert chunks[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert harness.all_requests()[-1].constraint.grammar.startswith('start: "<tool_call>" calls\ncalls: "\\n" body')


def test_token_id_prompt_and_detokenize(harness, tokenizer) -> None:
    ids = tokenizer.encode_prompt("Count: one two")
    harness.script_all(tokenizer.encode_prompt(" three") + [EOS_TOKEN_ID])
    chunks = list(harness.stub.Generate(pb.GenerateRequest(prompt_token_ids=ids), timeout=TIMEOUT_S))
    assert "".join(c.text for c in chunks) == " three"
    assert list(harness.all_requests()[-1].prompt_token_ids) == ids
    assert harness.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=TIMEOUT_S).text == "Count: one two"


@pytest.mark.parametrize("fields, named", [
    (dict(prompt="hi", tools=[TOOL]), "tools needs messages"),
    (dict(prompt="hi", chat_template_kwargs='{"enable_thinking": false}'), "chat_template_kwargs needs messages"),
    (dict(messages=[pb.ChatMessage(role="user", content="hi", tool_call_id="call_1")]), "messages[0].tool_call_id"),
    (dict(messages=CHAT, tool_choice=pb.ToolChoice(function_name="get_time")), "no tools"),
    (dict(messages=CHAT, tools=[TOOL, TOOL]), "tools[1].function.name 'get_time' is given twice"),
    (dict(messages=CHAT, tools=[pb.Tool(name="f", parameters="[1]")]), "tools[0].function.parameters"),
    (dict(messages=CHAT, chat_template_kwargs="[]"), "chat_template_kwargs must be a JSON object"),
    # SmolLM2's template reads no variable of the caller's, and this gateway splits no reasoning.
    (dict(messages=CHAT, chat_template_kwargs='{"enable_thinking": false}'),
     "chat_template_kwargs.enable_thinking: this model's chat template does not read it"),
    (dict(prompt="hi", prompt_token_ids=[1]), "prompt_token_ids alone"),
    (dict(messages=[pb.ChatMessage(role="assistant", content="", tool_calls=[
        pb.ToolCall(name="f", arguments="[]")])]), "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_agent_fields_are_invalid_argument_naming_them(harness, fields, named) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(harness.stub.Generate(pb.GenerateRequest(**fields), timeout=TIMEOUT_S))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        harness.stub.Detokenize(pb.DetokenizeRequest(token_ids=[10 ** 9]), timeout=TIMEOUT_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[0]" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        harness.stub.Detokenize(pb.DetokenizeRequest(token_ids=[1] * 600), timeout=TIMEOUT_S)
    assert caught.value.details() == "token_ids has 600 tokens, more than the limit of 512"


def test_tokenize_refuses_a_template_variable_the_template_does_not_read(harness) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        harness.stub.Tokenize(pb.TokenizeRequest(messages=CHAT, chat_template_kwargs='{"documents_v2": 1}'),
                              timeout=TIMEOUT_S)
    assert "chat_template_kwargs.documents_v2: this model's chat template does not read it" in caught.value.details()


def test_tokenize_checks_the_tool_history_too(harness) -> None:
    turn = pb.ChatMessage(role="assistant", content="", tool_calls=[pb.ToolCall(name="f", arguments="x" * 200_000)])
    with pytest.raises(grpc.RpcError) as caught:
        harness.stub.Tokenize(pb.TokenizeRequest(messages=[*CHAT, turn]), timeout=TIMEOUT_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tool calls have 200001 characters" in caught.value.details()
