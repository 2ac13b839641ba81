"""A gRPC request with a field number or an enum value generation.proto does not declare (a client
built from a newer .proto) is INVALID_ARGUMENT naming where it is, on every public call; it was
served as if the field were not there. Over real gRPC against fake routers."""

from __future__ import annotations

import grpc
import pytest

from gateway.harness import EOS_TOKEN_ID
from gateway_service.known_fields import check_known_fields
from radixserve.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(60)
TIMEOUT_S = 10
# Field 101 as a varint, then its value 1: a number no public message declares.
FIELD_101 = bytes([0xa8, 0x06, 0x01])


def with_unknown(message):
    """`message` as a client whose .proto has a field 101 more would send it."""
    return type(message).FromString(message.SerializeToString() + FIELD_101)


def chat(*extra_turns) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi"), *extra_turns], max_tokens=4)


def bad_generate_requests():
    top = with_unknown(pb.GenerateRequest(prompt="a", max_tokens=4))
    in_sampling = pb.GenerateRequest(prompt="a", max_tokens=4)
    in_sampling.sampling.CopyFrom(with_unknown(pb.SamplingParams(temperature=0.5)))
    in_message = chat(with_unknown(pb.ChatMessage(role="assistant", content="ok")))
    in_constraint = pb.GenerateRequest(prompt="a", max_tokens=4)
    in_constraint.constraint.CopyFrom(with_unknown(pb.Constraint(regex="[a-z]+")))
    in_tool = chat()
    in_tool.tools.append(pb.Tool(name="f"))
    in_tool.tools.append(with_unknown(pb.Tool(name="g")))
    mode_99 = chat()
    mode_99.tools.append(pb.Tool(name="f"))
    mode_99.tool_choice.mode = 99
    return [
        (top, "field number 101 is not part of this server's radixserve.v1.GenerateRequest"),
        (in_sampling, "sampling: field number 101 is not part of this server's radixserve.v1.SamplingParams"),
        (in_message, "messages[1]: field number 101"),
        (in_constraint, "constraint: field number 101"),
        (in_tool, "tools[1]: field number 101"),
        (mode_99, "tool_choice.mode: 99 is not a ToolChoiceMode (one of 0 (TOOL_CHOICE_MODE_UNSPECIFIED)"),
    ]


BAD = bad_generate_requests()


@pytest.mark.parametrize(("request_", "message"), BAD, ids=[m.split(":")[0][:40] for _, m in BAD])
def test_generate_refuses_what_the_api_does_not_declare(harness, request_, message):
    with pytest.raises(grpc.RpcError) as err:
        list(harness.stub.Generate(request_, timeout=TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert not harness.all_requests()  # nothing reached a router


def test_every_declared_field_set_passes(harness):
    """The check refuses only what is undeclared: a request with every field of every message set
    (each enum to a named value) is served."""
    harness.script_all([11, 12, EOS_TOKEN_ID])
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="hi"),
                  pb.ChatMessage(role="assistant", content="", tool_calls=[
                      pb.ToolCall(index=0, id="call_1", name="f", arguments='{"x": 1}')]),
                  pb.ChatMessage(role="tool", content="2", tool_call_id="call_1", name="f")],
        max_tokens=3, stop=["zz"], stop_token_ids=[5], ignore_eos=False, logprobs=True, top_logprobs=2,
        request_id="known-1", tools=[pb.Tool(name="f", description="d", parameters='{"type": "object"}')],
        parallel_tool_calls=True, chat_template_kwargs="{}",
        sampling=pb.SamplingParams(temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.1,
                                   presence_penalty=0.1, frequency_penalty=0.1, seed=7, logit_bias={3: 1.0}))
    request.tool_choice.mode = pb.TOOL_CHOICE_MODE_NONE
    chunks = list(harness.stub.Generate(request, timeout=TIMEOUT_S))
    assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED


def test_generate_many_refuses_the_request_or_the_call(harness):
    """An undeclared field inside a request fails that request alone (as its Generate call
    would); one on the ManyRequest itself fails the call, as a ManyRequest without an action does."""
    harness.script_all([11, 12, EOS_TOKEN_ID])
    bad, message = BAD[1]
    call = harness.stub.GenerateMany(iter([pb.ManyRequest(id=1, generate=pb.GenerateRequest(prompt="a", max_tokens=2)),
                                           pb.ManyRequest(id=2, generate=bad)]), timeout=TIMEOUT_S)
    updates = {}
    for response in call:
        for update in response.updates:
            updates.setdefault(update.id, []).append(update)
    assert updates[1][-1].code == 0 and updates[1][-1].response.finish_reason != 0
    (refused,) = updates[2]
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and message in refused.message

    outer = with_unknown(pb.ManyRequest(id=3, generate=pb.GenerateRequest(prompt="a", max_tokens=2)))
    with pytest.raises(grpc.RpcError) as err:
        list(harness.stub.GenerateMany(iter([outer]), timeout=TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "field number 101 is not part of this server's radixserve.v1.ManyRequest" in err.value.details()


@pytest.mark.parametrize("call", ["Tokenize", "Detokenize", "GetModelInfo", "Embed"])
def test_the_other_calls_refuse_it_too(harness, call):
    requests = {
        "Tokenize": pb.TokenizeRequest(prompt="hello"),
        "Detokenize": pb.DetokenizeRequest(token_ids=[11]),
        "GetModelInfo": pb.GetModelInfoRequest(),
        "Embed": pb.EmbedRequest(inputs=[pb.EmbedInput(text="hello")]),
    }
    with pytest.raises(grpc.RpcError) as err:
        getattr(harness.stub, call)(with_unknown(requests[call]), timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"radixserve.v1.{call}Request" in err.value.details()


def test_nested_false_leaves_held_messages_alone():
    """GenerateMany checks a ManyRequest's own fields as it reads it and its request when that
    starts (so the request fails alone): `nested=False` must not look inside."""
    outer = pb.ManyRequest(id=1, generate=with_unknown(pb.GenerateRequest(prompt="a")))
    check_known_fields(outer, nested=False)
    with pytest.raises(Exception, match="generate: field number 101"):
        check_known_fields(outer)
