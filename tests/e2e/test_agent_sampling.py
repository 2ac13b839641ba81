"""logit_bias through the agent tests' stack: with the openai client a bias of 100 forces a token
greedy decoding would not pick, and through the gRPC API a bias of -100 bans the greedy token.
Logprobs stay those of the model's own distribution (before the bias)."""

from __future__ import annotations

import grpc
import openai
import pytest

from e2e.agent_model import AGENT_MODEL
from e2e.stack import LaunchedStack
from radixserve.v1 import generation_pb2, generation_pb2_grpc

TIMEOUT_S = 60.0
PROMPT = [1, 504, 3000, 77, 12]  # token ids: the completion's text is compared as ids below


@pytest.fixture(scope="module")
def grpc_stub(agent_stack: LaunchedStack):
    with grpc.insecure_channel(agent_stack.gateway) as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)


def first_token(stub, **sampling) -> generation_pb2.TokenLogprob:
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=PROMPT, max_tokens=1, logprobs=True, ignore_eos=True,
        sampling=generation_pb2.SamplingParams(temperature=0, **sampling))
    (logprob,) = [lp for reply in stub.Generate(request, timeout=TIMEOUT_S) for lp in reply.logprobs]
    return logprob


@pytest.mark.timeout(120)
def test_a_strong_bias_forces_and_bans_tokens(agent_api, grpc_stub) -> None:
    greedy = first_token(grpc_stub)
    forced_id = 4242 if greedy.token_id != 4242 else 4243
    api = agent_api
    plain = api.completions.create(model=AGENT_MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1)
    biased = api.completions.create(model=AGENT_MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1,
                                    logit_bias={str(forced_id): 100})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        api.completions.create(model=AGENT_MODEL, prompt=PROMPT, max_tokens=1, logit_bias={"1": 101})
    forced = first_token(grpc_stub, logit_bias={forced_id: 100.0})
    assert forced.token_id == forced_id
    assert biased.choices[0].text == forced.token and plain.choices[0].text == greedy.token
    # Logprobs are before the bias: the forced token is less likely than the greedy one.
    assert biased.choices[0].logprobs.token_logprobs[0] == pytest.approx(forced.logprob, abs=1e-5)
    assert forced.logprob < greedy.logprob
    banned = first_token(grpc_stub, logit_bias={greedy.token_id: -100.0})
    assert banned.token_id != greedy.token_id
    with pytest.raises(grpc.RpcError) as failure:
        first_token(grpc_stub, logit_bias={10**8: 1.0})
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in failure.value.details()
