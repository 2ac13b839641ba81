"""The whole system at TP=1, started with `radixserve up`: greedy parity with transformers,
grpcurl, stop strings, max_tokens, cancellation freeing pages, bad requests, and the gateway
draining on SIGTERM, after which the launcher stops everything (last: it ends the shared stack).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve_client import AsyncClient, Client
from e2e.faults import RecordedStream, greedy, serves, wait_until
from e2e.grpcurl_call import GRPCURL, readme_generate
from e2e.parity import check_greedy_parity
from e2e.reference import CHATS, MAX_NEW_TOKENS
from e2e.stack import LaunchedStack, launch, wait_gone
from gateway.strategies import generate_requests
from procs import ServiceProcesses, is_serving
from radixserve.v1 import generation_pb2 as pb
from radixserve.serving import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from radixserve.stack_plan import WORKER_PORT_OFFSET
from radixserve.v1 import generation_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

# The gateway's default --shutdown-grace-s, and what its drained streams generate.
GATEWAY_GRACE_S = 20.0
DRAIN_TOKENS = 24


@pytest.fixture(scope="module")
def stack(smollm2_dir):
    with ServiceProcesses() as procs:
        yield launch(procs, smollm2_dir, tp=1)


def router_stats(stack: LaunchedStack) -> router_pb2.GetStatsResponse:
    with grpc.insecure_channel(stack.router) as channel:
        return router_pb2_grpc.RouterServiceStub(channel).GetStats(
            router_pb2.GetStatsRequest(), timeout=5, metadata=stack.internal_metadata())


def nothing_locked(stats: router_pb2.GetStatsResponse) -> bool:
    """No request runs or waits and every page is free or merely cached (evictable)."""
    return (
        stats.num_running == 0 and stats.num_waiting == 0
        and stats.num_pages_free + stats.num_pages_evictable == stats.num_pages_total
    )


def wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(CHATS)))
def test_greedy_chat_matches_transformers(stack, references, index):
    check_greedy_parity(stack.gateway, index, references[index])


@pytest.mark.timeout(300)
def test_concurrent_chats_sharing_a_prefix_match_transformers(stack, references):
    """The chats share their template's leading pages: decoding them in one batch takes the
    cascade (shared-prefix) attention path, and greedy output is still transformers' own."""

    def ask(index: int) -> list[int]:
        with Client(stack.gateway) as client:
            return client.generate(messages=CHATS[index], max_tokens=MAX_NEW_TOKENS, temperature=0,
                                   timeout=240).token_ids

    with ThreadPoolExecutor(max_workers=len(CHATS)) as pool:
        outputs = list(pool.map(ask, range(len(CHATS))))
    assert outputs == [reference.output_ids for reference in references]


@pytest.mark.timeout(300)
def test_chats_on_one_generate_many_call_match_transformers(stack, references):
    """The same chats as requests of one GenerateMany call (their output shares messages)."""
    with Client(stack.gateway) as client:
        results = client.generate_many(
            [{"messages": chat, "max_tokens": MAX_NEW_TOKENS, "temperature": 0} for chat in CHATS], timeout=240)
    assert [result.token_ids for result in results] == [reference.output_ids for reference in references]


@pytest.mark.timeout(300)
def test_concurrent_chats_on_a_multiplexing_client_match_transformers(stack, references):
    """The same chats from asyncio tasks on one AsyncClient(multiplex=True): their requests share
    a GenerateMany call, and each gives transformers' greedy output."""

    async def ask_all():
        async with AsyncClient(stack.gateway, multiplex=True) as client:
            return await asyncio.gather(*(
                client.generate(messages=chat, max_tokens=MAX_NEW_TOKENS, temperature=0, timeout=240)
                for chat in CHATS))

    results = asyncio.run(ask_all())
    assert [result.token_ids for result in results] == [reference.output_ids for reference in references]


@pytest.mark.timeout(120)
def test_repeated_chat_hits_the_prefix_cache(stack, references):
    with Client(stack.gateway) as client:
        result = client.generate(messages=CHATS[0], max_tokens=MAX_NEW_TOKENS, temperature=0, timeout=60)
    assert result.token_ids == references[0].output_ids
    assert 0 < result.usage.cached_tokens < result.usage.prompt_tokens


@pytest.mark.timeout(120)
def test_logprobs_come_with_token_text(stack, references, smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    with Client(stack.gateway) as client:
        result = client.generate(messages=CHATS[0], max_tokens=MAX_NEW_TOKENS, temperature=0,
                                 logprobs=True, top_logprobs=3, timeout=60)
    assert result.token_ids == references[0].output_ids
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    for lp in result.logprobs:
        assert lp.token == tokenizer.decode([lp.token_id])
        assert lp.logprob <= 0.0
        assert len(lp.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert lp.top_logprobs[0].token_id == lp.token_id
        assert lp.top_logprobs[0].token == lp.token
        assert [t.logprob for t in lp.top_logprobs] == sorted((t.logprob for t in lp.top_logprobs), reverse=True)


@pytest.mark.timeout(120)
def test_grpcurl_lists_the_service_and_streams_the_readme_call(stack):
    listed = subprocess.run([GRPCURL, "-plaintext", stack.gateway, "list"],
                            capture_output=True, text=True, timeout=30)
    assert "radixserve.v1.GenerationService" in listed.stdout.split(), listed.stderr
    chunks = readme_generate(stack.gateway)
    assert len(chunks) > 1 and "finish_reason" in chunks[-1]
    assert chunks[-1]["usage"]["completion_tokens"] == sum(len(c.get("token_ids", [])) for c in chunks)


@pytest.mark.timeout(120)
def test_stop_string_and_max_tokens(stack, references):
    reference = references[1]  # "The sky blue is a result of the Earth's atmosphere ..."
    cut = reference.text.index(" the Earth")
    with Client(stack.gateway) as client:
        limited = client.generate(messages=CHATS[1], max_tokens=5, temperature=0, timeout=60)
        stopped = client.generate(messages=CHATS[1], max_tokens=MAX_NEW_TOKENS, temperature=0,
                                  stop=["Earth's", "zebra"], timeout=60)
    assert stopped.text == reference.text[:cut] + " the "
    assert stopped.finish_reason == "stop"
    # The same prompt ran just before: a stop string ends the stream early, and the usage still
    # reports the prompt tokens served from the cache.
    assert stopped.usage.prompt_tokens == limited.usage.prompt_tokens
    assert 0 < stopped.usage.cached_tokens < stopped.usage.prompt_tokens
    assert stopped.token_ids == reference.output_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(reference.output_ids)
    assert limited.finish_reason == "length"
    assert limited.token_ids == reference.output_ids[:5]
    assert limited.usage.completion_tokens == 5
    assert wait_for(lambda: nothing_locked(router_stats(stack)))


@pytest.mark.timeout(120)
def test_cancellation_through_the_gateway_frees_the_routers_pages(stack):
    assert wait_for(lambda: nothing_locked(router_stats(stack)))
    baseline = router_stats(stack)
    with grpc.insecure_channel(stack.gateway) as channel:
        call = generation_pb2_grpc.GenerationServiceStub(channel).Generate(
            pb.GenerateRequest(prompt="Count from one to one thousand: one, two,", max_tokens=1000,
                               ignore_eos=True, sampling=pb.SamplingParams(temperature=0)),
            timeout=120,
        )
        received = 0
        for response in call:
            received += len(response.token_ids)
            if received >= 20:
                break
        during = router_stats(stack)
        assert during.num_running == 1
        assert during.num_pages_free + during.num_pages_evictable < during.num_pages_total
        call.cancel()
    assert wait_for(lambda: nothing_locked(router_stats(stack)))
    after = router_stats(stack)
    assert after.num_pages_total == baseline.num_pages_total


@pytest.mark.timeout(240)
def test_generated_bad_requests_on_the_real_stack(stack):
    channel = grpc.insecure_channel(stack.gateway)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    # Valid requests stay short (unset max_tokens: the stack's default of 16); the large
    # values are all past the model's context of 8192, so they must be refused.
    small = st.one_of(st.none(), st.integers(-3, 4), st.integers(8192, 2**31 - 1))

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(request_=generate_requests(max_tokens=small))
    def answer_is_ok_or_invalid_argument(request_):
        try:
            responses = list(stub.Generate(request_, timeout=60))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
        else:
            assert responses[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)

    try:
        answer_is_ok_or_invalid_argument()
        still_there = pb.GenerateRequest(prompt="Still there?", max_tokens=3, ignore_eos=True,
                                         sampling=pb.SamplingParams(temperature=0))
        responses = list(stub.Generate(still_there, timeout=60))
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        channel.close()
    assert wait_for(lambda: nothing_locked(router_stats(stack)))


# gRPC keepalive: a ping every 10 s, answered within 5 s (radixserve.serving), plus slack.
KEEPALIVE_WINDOW_S = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 5
# Long enough to fill whole pages, which the cache keeps.
CACHED_PROMPT = "What is the capital of France? Answer in one word, then name three rivers " * 3


def _poison_task() -> worker_pb2.DecodeTask:
    """What issue 34's attacker sent: a reset, and token 1234 written over pages 0-10."""
    task = worker_pb2.DecodeTask(task_id=99, reset=True)
    task.entries.add(request_id="evil", token_ids=[1234] * 16, start_position=0,
                     page_ids=list(range(11)), sample=False)
    return task


@pytest.mark.timeout(120)
def test_default_launch_refuses_internal_callers_without_its_token(stack):
    """No security flag given: the router and the worker still refuse callers without the
    launch's own token, and the cached answer stays what it was."""
    before = greedy(stack.gateway, prompt=CACHED_PROMPT)
    assert wait_for(lambda: nothing_locked(router_stats(stack)))
    # The request's last steps (its final one, the one that releases it on the workers) may
    # still be counted after its caller has the answer and its pages are free: settled stats
    # are two reads a second apart that agree.
    reads = [router_stats(stack)]

    def unchanged_for_a_second() -> bool:
        time.sleep(1.0)
        reads.append(router_stats(stack))
        return reads[-1] == reads[-2]

    assert wait_for(unchanged_for_a_second)
    stats_before = reads[-1]
    worker = f"127.0.0.1:{stack.port + WORKER_PORT_OFFSET}"
    with grpc.insecure_channel(worker) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(worker_pb2_grpc.WorkerServiceStub(channel).Execute(iter([_poison_task()]), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(stack.router) as channel:
        router = router_pb2_grpc.RouterServiceStub(channel)
        request = router_pb2.RouterGenerateRequest(request_id="direct", prompt_token_ids=[1, 2, 3],
                                                   max_tokens=4)
        with pytest.raises(grpc.RpcError) as err:
            list(router.Generate(request, timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            router.GetStats(router_pb2.GetStatsRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    after = router_stats(stack)
    changed = [field.name for field, _ in after.ListFields() if getattr(stats_before, field.name) != _]
    assert after == stats_before, f"changed without an authenticated call: {changed}"  # no step, no page
    assert greedy(stack.gateway, prompt=CACHED_PROMPT) == before
    assert router_stats(stack).cache_hit_tokens > stats_before.cache_hit_tokens


@pytest.mark.timeout(300)
def test_a_frozen_router_is_noticed_by_the_gateway_within_the_keepalive_window(stack):
    """SIGSTOP on the router with a stream in flight: the gateway's probes go unanswered, so it
    goes NOT_SERVING and, the router silent for the keepalive time, ends the stream UNAVAILABLE
    (README: ~15-20 s); SIGCONT: serving again."""
    wait_until(lambda: serves(stack.gateway), 60, interval_s=0.5)
    router = stack.child_pids()["router"]
    stream = RecordedStream(stack.gateway, max_tokens=1000).start()
    assert stream.started.wait(60) and stream.code is None
    os.kill(router, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        assert stream.done.wait(KEEPALIVE_WINDOW_S + 10)
        assert stream.code == grpc.StatusCode.UNAVAILABLE
        assert not is_serving(stack.gateway)
    finally:
        os.kill(router, signal.SIGCONT)
    ended_s = stream.ended_at - frozen_at
    wait_until(lambda: serves(stack.gateway), 60, interval_s=0.5)
    print(f"frozen router: the in-flight stream ended UNAVAILABLE after {ended_s:.1f}s")
    assert ended_s < KEEPALIVE_WINDOW_S
    assert stack.child_pids()["router"] == router  # frozen, not dead: nothing restarted


@pytest.mark.timeout(180)
def test_a_dead_router_is_restarted_and_serves_again(stack):
    before = greedy(stack.gateway)
    old = stack.child_pids()["router"]
    os.kill(old, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: stack.child_pids()["router"] != old, 30)
    wait_until(lambda: serves(stack.gateway), 120, interval_s=0.5)
    print(f"serving again {time.monotonic() - killed_at:.1f}s after SIGKILL of the router")
    assert "router exited with code -9; restarting the router" in stack.output()
    assert greedy(stack.gateway) == before
    assert stack.launcher.poll() is None


@pytest.mark.timeout(120)
def test_gateway_sigterm_drains_eight_streams_then_the_launcher_stops_the_stack(stack):
    """Runs last in this module: it takes the shared stack down. SIGTERM on the gateway: at
    once NOT_SERVING and new calls refused, the 8 open streams all complete, the gateway exits
    0 within its grace period; the launcher then stops the rest, as for any child that dies
    (a worker rank that dies is restarted with its group instead: see test_stack_tp2)."""
    pids = stack.child_pids()
    assert set(pids) == {"worker0", "router", "gateway"}
    streams = [RecordedStream(stack.gateway, max_tokens=DRAIN_TOKENS).start() for _ in range(8)]
    assert all(stream.started.wait(60) for stream in streams)
    os.kill(pids["gateway"], signal.SIGTERM)
    sent_at = time.monotonic()
    in_flight = sum(not stream.done.is_set() for stream in streams)
    wait_until(lambda: not is_serving(stack.gateway, timeout_s=0.5), 2.0, interval_s=0.05)
    with pytest.raises(grpc.RpcError) as refused:
        greedy(stack.gateway, max_tokens=2, timeout_s=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert wait_gone([pids["gateway"]], GATEWAY_GRACE_S + 5) == []
    assert time.monotonic() - sent_at < GATEWAY_GRACE_S
    assert in_flight == 8
    for stream in streams:
        assert stream.done.wait(5)
        assert (stream.code, len(stream.token_ids)) == (grpc.StatusCode.OK, DRAIN_TOKENS)
    assert stack.launcher.wait(timeout=60) == 1
    output = stack.output()
    assert "gateway exited with code 0; stopping the stack" in output
    # Every child's output reached the launcher's, prefixed with the child's name.
    for name in pids:
        assert f"\n[{name}] " in output
    assert wait_gone(list(pids.values())) == []
