"""Bad requests are INVALID_ARGUMENT with a message naming the problem; never INTERNAL/UNKNOWN."""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from gateway.harness import CONTEXT_LEN, EOS_TOKEN_ID, VOCAB_SIZE
from gateway.strategies import generate_requests
from radixserve.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(120)

user = pb.ChatMessage(role="user", content="hi")

BAD_REQUESTS = [
    (pb.GenerateRequest(), "prompt or messages is required"),
    (pb.GenerateRequest(prompt="a", messages=[user]), "not both"),
    (pb.GenerateRequest(messages=[pb.ChatMessage(role="robot", content="x")]), "messages[0].role"),
    (pb.GenerateRequest(messages=[user, pb.ChatMessage(role="user", content="")]), "messages[1].content"),
    (pb.GenerateRequest(prompt="a", max_tokens=0), "max_tokens must be >= 1"),
    (pb.GenerateRequest(prompt="a", max_tokens=-5), "max_tokens must be >= 1"),
    (pb.GenerateRequest(prompt="a", max_tokens=CONTEXT_LEN), "exceeds the model's context"),
    (pb.GenerateRequest(prompt="word " * (CONTEXT_LEN + 10)), "leaves no room"),
    (pb.GenerateRequest(prompt="a", logprobs=True, top_logprobs=21), "top_logprobs must be in [0, 20]"),
    (pb.GenerateRequest(prompt="a", logprobs=True, top_logprobs=-1), "top_logprobs must be in [0, 20]"),
    (pb.GenerateRequest(prompt="a", top_logprobs=3), "top_logprobs needs logprobs"),
    (pb.GenerateRequest(prompt="a", stop=["ok", ""]), "stop[1] is empty"),
    (pb.GenerateRequest(prompt="a", stop=["x"] * 33), "at most 32 stop strings"),
    (pb.GenerateRequest(prompt="a", stop=["x" * 513]), "stop[0] is longer than 512"),
    (pb.GenerateRequest(prompt="a", stop_token_ids=[VOCAB_SIZE]), "stop_token_ids[0]"),
    (pb.GenerateRequest(prompt="a", stop_token_ids=[-1]), "outside the vocabulary"),
    (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(temperature=2.5)), "sampling.temperature"),
    (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(temperature=-0.1)), "sampling.temperature"),
    (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(temperature=math.nan)), "finite"),
    (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(top_p=0)), "sampling.top_p must be in (0, 1]"),
    (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(top_p=math.inf)), "sampling.top_p"),
    (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(top_k=-2)), "sampling.top_k"),
    (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(min_p=1.5)), "sampling.min_p"),
    (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(repetition_penalty=0)), "sampling.repetition_penalty"),
    (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(presence_penalty=-2.5)), "sampling.presence_penalty"),
    (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(frequency_penalty=-math.inf)), "sampling.frequency_penalty"),
]


@pytest.mark.parametrize(("request_", "message"), BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_bad_request_is_invalid_argument(harness, request_, message):
    with pytest.raises(grpc.RpcError) as err:
        list(harness.stub.Generate(request_, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert not harness.all_requests()  # nothing reached a router


def test_top_k_minus_one_is_vllms_off(harness):
    """vLLM's clients send top_k -1 for "every token": served as 0, off (-2 is still refused)."""
    harness.script_all([11, 12, EOS_TOKEN_ID])
    list(harness.stub.Generate(pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(top_k=-1, temperature=1)),
                               timeout=10))
    assert harness.all_requests()[-1].sampling.top_k == 0


def test_tokenize_validates_too(harness):
    with pytest.raises(grpc.RpcError) as err:
        harness.stub.Tokenize(pb.TokenizeRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# --- generated requests ------------------------------------------------------------------


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request_=generate_requests())
def test_generated_requests_are_ok_or_invalid_argument(harness, request_):
    harness.script_all([11, 12, EOS_TOKEN_ID])
    try:
        responses = list(harness.stub.Generate(request_, timeout=10))
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
        assert exc.details()
    else:
        assert responses[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)


def test_still_serving_after_bad_requests(harness):
    harness.script_all([11, EOS_TOKEN_ID])
    responses = list(harness.stub.Generate(pb.GenerateRequest(prompt="fine"), timeout=10))
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
