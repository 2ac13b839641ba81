"""The gateway's Generate / Tokenize / GetModelInfo over real gRPC, against fake routers."""

from __future__ import annotations

import time

import grpc
import pytest

from gateway.harness import CONTEXT_LEN, EOS_TOKEN_ID
from gateway_service.rendezvous import affinity_key, rendezvous_order
from radixserve.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(60)

TEXT = "Hello world! 😀 Ça va? 世界 ok"


def collect(stub, request, timeout=10.0) -> list[pb.GenerateResponse]:
    return list(stub.Generate(request, timeout=timeout))


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_prompt_streams_text_usage_and_resolved_request(harness, tokenizer):
    output_ids = tokenizer.encode_prompt(TEXT) + [EOS_TOKEN_ID]
    harness.script_all(output_ids)
    responses = collect(harness.stub, pb.GenerateRequest(prompt="Say hi", sampling=pb.SamplingParams(temperature=0)))
    assert "".join(r.text for r in responses) == TEXT
    assert [t for r in responses for t in r.token_ids] == output_ids
    assert all(r.finish_reason == 0 for r in responses[:-1])
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_STOP
    assert last.usage.prompt_tokens == len(tokenizer.encode_prompt("Say hi"))
    assert last.usage.completion_tokens == len(output_ids)
    (sent,) = harness.all_requests()
    assert list(sent.prompt_token_ids) == tokenizer.encode_prompt("Say hi")
    assert sent.max_tokens == 64  # --default-max-tokens, the context leaves more
    assert sent.sampling.temperature == 0.0  # explicit 0 is greedy, not the default 1.0
    assert sent.sampling.top_p == 1.0 and sent.sampling.top_k == 0
    assert sent.sampling.repetition_penalty == 1.0 and not sent.sampling.has_seed


def test_unset_temperature_is_the_default_and_seed_travels(harness):
    harness.script_all([EOS_TOKEN_ID])
    collect(harness.stub, pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(seed=7, top_k=10**6)))
    (sent,) = harness.all_requests()
    assert sent.sampling.temperature == 1.0
    assert sent.sampling.has_seed and sent.sampling.seed == 7
    assert sent.sampling.top_k == 49152  # clamped to the vocabulary


def test_chat_applies_the_template_with_generation_prompt(harness, tokenizer):
    harness.script_all([EOS_TOKEN_ID])
    messages = [pb.ChatMessage(role="system", content="Be brief."), pb.ChatMessage(role="user", content="Hi")]
    collect(harness.stub, pb.GenerateRequest(messages=messages))
    (sent,) = harness.all_requests()
    expected = tokenizer._hf.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    assert list(sent.prompt_token_ids) == list(expected)
    reply = harness.stub.Tokenize(pb.TokenizeRequest(messages=messages), timeout=5)
    assert list(reply.token_ids) == list(expected)


def test_unset_max_tokens_is_capped_by_the_context(harness, tokenizer):
    harness.script_all([EOS_TOKEN_ID])
    prompt = "word " * 480
    prompt_len = len(tokenizer.encode_prompt(prompt))
    assert CONTEXT_LEN - prompt_len < 64
    collect(harness.stub, pb.GenerateRequest(prompt=prompt))
    (sent,) = harness.all_requests()
    assert sent.max_tokens == CONTEXT_LEN - prompt_len


def test_max_tokens_finishes_with_length(harness, tokenizer):
    harness.script_all(tokenizer.encode_prompt(TEXT))
    responses = collect(harness.stub, pb.GenerateRequest(prompt="x", max_tokens=3))
    assert sum(len(r.token_ids) for r in responses) == 3
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert responses[-1].usage.completion_tokens == 3


def test_stop_string_across_tokens_cuts_text_and_cancels_the_router(harness, tokenizer):
    text = "The answer is 42. THE END of the story and more words after it"
    ids = tokenizer.encode_prompt(text)
    harness.script_all(ids, chunk_size=2, delay_s=0.05)
    responses = collect(harness.stub, pb.GenerateRequest(prompt="x", stop=["E END", "zzz"]))
    assert "".join(r.text for r in responses) == "The answer is 42. TH"
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    streamed = [t for r in responses for t in r.token_ids]
    assert streamed == ids[: len(streamed)] and len(streamed) < len(ids)
    assert tokenizer.decode(streamed).startswith("The answer is 42. THE END")
    assert responses[-1].usage.completion_tokens == len(streamed)
    (sent,) = harness.all_requests()
    assert wait_until(lambda: sent.request_id in harness.all_cancelled())


def test_logprobs_get_token_text(harness, tokenizer):
    ids = tokenizer.encode_prompt("Hello there")
    harness.script_all(ids)
    responses = collect(harness.stub, pb.GenerateRequest(prompt="x", max_tokens=len(ids), logprobs=True, top_logprobs=2))
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert [lp.token_id for lp in logprobs] == ids
    assert [lp.token for lp in logprobs] == [tokenizer.token_text(t) for t in ids]
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[1].token for lp in logprobs)
    (sent,) = harness.all_requests()
    assert sent.sampling.logprobs and sent.sampling.top_logprobs == 2


def test_same_prefix_goes_to_the_same_router_and_prompts_spread(harness, tokenizer):
    harness.script_all([EOS_TOKEN_ID])
    shared = "Shared system preamble that is long enough to cover the affinity window. " * 2
    for tail in ("first question", "second question", "third"):
        collect(harness.stub, pb.GenerateRequest(prompt=shared + tail))
    counts = [len(r.state.requests) for r in harness.routers]
    assert sorted(counts) == [0, 3]
    for i in range(12):
        collect(harness.stub, pb.GenerateRequest(prompt=f"{i} distinct prompt number {i * 7919}"))
    counts = [len(r.state.requests) for r in harness.routers]
    assert min(counts) > 0, counts


def test_failover_when_the_preferred_router_is_unavailable(harness, tokenizer):
    prompt_ids = tokenizer.encode_prompt("failover please")
    preferred = rendezvous_order([r.address for r in harness.routers], affinity_key(prompt_ids, 16))[0]
    for router in harness.routers:
        fail = grpc.StatusCode.UNAVAILABLE if router.address == preferred else None
        router.script([EOS_TOKEN_ID], fail_with=fail)
    responses = collect(harness.stub, pb.GenerateRequest(prompt="failover please"))
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    by_address = {r.address: r.state for r in harness.routers}
    assert len(by_address[preferred].requests) == 1
    assert all(len(s.finished) == 1 for a, s in by_address.items() if a != preferred)


def test_all_routers_unavailable_is_unavailable(harness):
    for router in harness.routers:
        router.script([EOS_TOKEN_ID], fail_with=grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(grpc.RpcError) as err:
        collect(harness.stub, pb.GenerateRequest(prompt="x"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no router could take the request" in err.value.details()


def test_router_resource_exhausted_is_passed_through(harness):
    harness.script_all([EOS_TOKEN_ID], fail_with=grpc.StatusCode.RESOURCE_EXHAUSTED)
    with pytest.raises(grpc.RpcError) as err:
        collect(harness.stub, pb.GenerateRequest(prompt="x"))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(harness.all_requests()) == 1  # not retried elsewhere: the router is up


def test_deadline_propagates_to_the_router(harness, tokenizer):
    harness.script_all(tokenizer.encode_prompt(TEXT) * 50, delay_s=0.05)
    with pytest.raises(grpc.RpcError) as err:
        collect(harness.stub, pb.GenerateRequest(prompt="x", max_tokens=400), timeout=1.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    (sent,) = harness.all_requests()
    # The router's call had the caller's deadline: it ended with it, not after all tokens.
    assert wait_until(lambda: sent.request_id in harness.all_cancelled())
    assert not any(r.state.finished for r in harness.routers)


def test_client_cancel_cancels_the_router_call(harness, tokenizer):
    harness.script_all(tokenizer.encode_prompt(TEXT) * 50, delay_s=0.02)
    call = harness.stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=400), timeout=30)
    first = next(call)
    assert first.token_ids
    call.cancel()
    (sent,) = harness.all_requests()
    assert wait_until(lambda: sent.request_id in harness.all_cancelled())


def test_request_id_is_kept_as_a_prefix_and_made_unique(harness):
    harness.script_all([EOS_TOKEN_ID])
    for _ in range(2):
        collect(harness.stub, pb.GenerateRequest(prompt="x", request_id="mine"))
    ids = [r.request_id for r in harness.all_requests()]
    assert all(i.startswith("mine-") for i in ids) and len(set(ids)) == 2


def test_model_info_and_health(harness):
    info = harness.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert (info.model_name, info.context_len, info.page_size) == ("fake-smollm2", CONTEXT_LEN, 16)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(harness.channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service="radixserve.v1.GenerationService"), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
