"""GenerateMany: many requests on one gRPC call (issue 37). Each request's output, put together
from its updates, is exactly what its own Generate call streams (text, tokens, logprobs, finish
reason, usage), also when a stop string cuts it and when the updates of several requests share
messages; a failed or cancelled request ends alone with its status; the call fails only for its
own faults, and then cancels what it had open on the routers. The call's machinery in one
process (ordering, bounds, back-pressure): test_many_call.py."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from gateway.fake_stream_router import StreamingFakeRouter
from gateway.harness import GatewayHarness, running_harness, stream_summary
from radixserve.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(60)
TEXT = "Many requests share one call: naïve café 😀 世界. The end is here STOP and never this part."
STOP = "STOP"
MAX_OPEN = 8
CALL_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def harness(tokenizer) -> Iterator[GatewayHarness]:
    with running_harness(tokenizer, num_routers=2, router_class=StreamingFakeRouter,
                         settings={"max_requests_per_call": MAX_OPEN}) as running:
        yield running


@pytest.fixture(scope="module")
def token_ids(tokenizer) -> list[int]:
    return tokenizer.encode_prompt(TEXT, add_special_tokens=False)


class ManyCall:
    """A GenerateMany call whose requests the test sends as it goes (a queue feeds the call)."""

    def __init__(self, harness: GatewayHarness) -> None:
        self._outgoing: queue.Queue[pb.ManyRequest | None] = queue.Queue()
        self.call = harness.stub.GenerateMany(iter(self._outgoing.get, None), timeout=CALL_TIMEOUT_S)

    def start(self, request_id: int, request: pb.GenerateRequest) -> None:
        self._outgoing.put(pb.ManyRequest(id=request_id, generate=request))

    def cancel(self, request_id: int) -> None:
        self._outgoing.put(pb.ManyRequest(id=request_id, cancel=True))

    def send(self, message: pb.ManyRequest) -> None:
        self._outgoing.put(message)

    def close(self) -> None:
        self._outgoing.put(None)

    def read_all(self) -> list[pb.ManyResponse]:
        return list(self.call)


def by_request(messages: list[pb.ManyResponse]) -> dict[int, list[pb.ManyUpdate]]:
    updates: dict[int, list[pb.ManyUpdate]] = {}
    for message in messages:
        for update in message.updates:
            updates.setdefault(update.id, []).append(update)
    return updates


REQUESTS = [
    pb.GenerateRequest(prompt="hello", max_tokens=200, ignore_eos=True),
    pb.GenerateRequest(prompt="stop me", max_tokens=200, stop=[STOP], logprobs=True, top_logprobs=2,
                       ignore_eos=True),
    pb.GenerateRequest(prompt="short", max_tokens=3, ignore_eos=True),
    pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi there")], max_tokens=200,
                       ignore_eos=True),
    pb.GenerateRequest(prompt="logprobs", max_tokens=7, logprobs=True, ignore_eos=True),
    pb.GenerateRequest(prompt="a longer prompt that goes elsewhere " * 3, max_tokens=200, stop=["café"],
                       ignore_eos=True),
    pb.GenerateRequest(prompt_token_ids=[1, 2, 3, 4], max_tokens=12, ignore_eos=True),
    pb.GenerateRequest(prompt="the last one", max_tokens=200, stop=["😀"], ignore_eos=True),
]


def test_each_request_reads_as_its_own_generate_call(harness, token_ids) -> None:
    harness.script_all(token_ids)
    call = ManyCall(harness)
    for index, request in enumerate(REQUESTS):
        call.start(100 + index, request)
    call.close()
    messages = call.read_all()
    updates = by_request(messages)
    assert sorted(updates) == [100 + i for i in range(len(REQUESTS))]
    num_chunks = 0
    for index, request in enumerate(REQUESTS):
        got = updates[100 + index]
        assert all(update.code == 0 and not update.message for update in got)
        assert got[-1].response.finish_reason != 0 and all(u.response.finish_reason == 0 for u in got[:-1])
        reference = list(harness.stub.Generate(request, timeout=CALL_TIMEOUT_S))
        assert stream_summary([u.response for u in got]) == stream_summary(reference), f"request {index}"
        num_chunks += len(got)
    # The stop strings cut where they should (the reference says the same; this says it is not empty).
    assert stream_summary([u.response for u in updates[101]])["text"] == TEXT[:TEXT.index(STOP)]
    assert stream_summary([u.response for u in updates[102]])["finish_reason"] == pb.FINISH_REASON_LENGTH
    # Updates of several requests shared messages.
    assert len(messages) < num_chunks
    assert any(len({u.id for u in message.updates}) > 1 for message in messages)
    # Counted as requests of a GenerateMany call (the references as Generate calls).
    registry = harness.gateway.servicer.metrics.registry
    counted = sum(registry.get_sample_value("radixserve:requests_total", {
        "model_name": "fake-smollm2", "api": "grpc_many", "status": "ok", "finish_reason": finish}) or 0
        for finish in ("stop", "length"))
    assert counted >= len(REQUESTS)


def test_a_failed_request_ends_alone_with_generates_status(harness, token_ids) -> None:
    harness.script_all(token_ids)
    bad = [
        pb.GenerateRequest(prompt="both", messages=[pb.ChatMessage(role="user", content="x")]),
        pb.GenerateRequest(prompt="too long", max_tokens=10_000),
        pb.GenerateRequest(prompt="bad sampling", sampling=pb.SamplingParams(temperature=-1)),
        pb.GenerateRequest(),
    ]
    call = ManyCall(harness)
    call.start(1, pb.GenerateRequest(prompt="fine", max_tokens=20, ignore_eos=True))
    for index, request in enumerate(bad):
        call.start(10 + index, request)
    call.close()
    updates = by_request(call.read_all())
    assert updates[1][-1].response.finish_reason == pb.FINISH_REASON_LENGTH
    assert len([t for u in updates[1] for t in u.response.token_ids]) == 20
    for index, request in enumerate(bad):
        (update,) = updates[10 + index]
        with pytest.raises(grpc.RpcError) as raised:
            list(harness.stub.Generate(request, timeout=CALL_TIMEOUT_S))
        assert update.code == raised.value.code().value[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert update.message == raised.value.details()


def test_cancel_ends_one_request_on_the_router_and_the_rest_go_on(harness, token_ids) -> None:
    harness.script_all(token_ids * 20, delay_s=0.02)
    call = ManyCall(harness)
    call.start(1, pb.GenerateRequest(prompt="long", max_tokens=500, ignore_eos=True))
    call.start(2, pb.GenerateRequest(prompt="short", max_tokens=10, ignore_eos=True))
    seen: dict[int, list[pb.ManyUpdate]] = {}
    cancelled_sent = False
    for message in call.call:
        for update in message.updates:
            seen.setdefault(update.id, []).append(update)
        if not cancelled_sent and len(seen.get(1, [])) >= 3:
            call.cancel(1)
            call.cancel(777)  # not open: ignored
            cancelled_sent = True
        if seen.get(2) and seen[2][-1].response.finish_reason and seen.get(1) and seen[1][-1].code:
            call.close()
    last = seen[1][-1]
    assert last.code == grpc.StatusCode.CANCELLED.value[0]
    assert len([t for u in seen[1] for t in u.response.token_ids]) < 500
    assert seen[2][-1].response.finish_reason == pb.FINISH_REASON_LENGTH
    assert 777 not in seen
    long_id = next(r.request_id for r in harness.all_requests() if r.max_tokens == 500)
    deadline = time.monotonic() + 10
    while not harness.all_cancelled() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert harness.all_cancelled() == [long_id]


def test_a_cancel_right_behind_its_start_ends_the_request(harness, token_ids) -> None:
    """Starts and cancels sent in one burst over gRPC: each request ends with one CANCELLED update
    and the call ends. (grpc.aio yields between the messages it reads, so here each request's task
    has started before its cancel is read; the test below takes the order where it has not.)"""
    harness.script_all(token_ids * 20, delay_s=0.02)
    burst = []
    for index in range(MAX_OPEN):
        burst.append(pb.ManyRequest(id=index, generate=pb.GenerateRequest(prompt=f"p{index}", max_tokens=500,
                                                                         ignore_eos=True)))
        burst.append(pb.ManyRequest(id=index, cancel=True))
    updates = by_request(list(harness.stub.GenerateMany(iter(burst), timeout=CALL_TIMEOUT_S)))
    assert sorted(updates) == list(range(MAX_OPEN))
    for index, got in updates.items():
        assert got[-1].code == grpc.StatusCode.CANCELLED.value[0], index
        assert all(update.code == 0 for update in got[:-1])


def test_an_id_may_be_reused_once_its_request_ended(harness, token_ids) -> None:
    harness.script_all(token_ids)
    call = ManyCall(harness)
    call.start(5, pb.GenerateRequest(prompt="first", max_tokens=4, ignore_eos=True))
    outputs = []
    for message in call.call:
        for update in message.updates:
            if update.response.finish_reason:
                outputs.append(update.response.usage.completion_tokens)
                if len(outputs) == 1:
                    call.start(5, pb.GenerateRequest(prompt="second", max_tokens=6, ignore_eos=True))
                else:
                    call.close()
    assert outputs == [4, 6]


def test_more_open_requests_than_the_limit_are_refused_one_by_one(harness, token_ids) -> None:
    harness.script_all(token_ids * 10, delay_s=0.02)
    call = ManyCall(harness)
    for index in range(MAX_OPEN + 2):
        call.start(index, pb.GenerateRequest(prompt=f"p{index}", max_tokens=20, ignore_eos=True))
    call.close()
    updates = by_request(call.read_all())
    refused = [i for i, got in updates.items() if got[-1].code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
    served = [i for i, got in updates.items() if got[-1].response.finish_reason == pb.FINISH_REASON_LENGTH]
    assert sorted(refused) == [MAX_OPEN, MAX_OPEN + 1] and sorted(served) == list(range(MAX_OPEN))
    assert "max-requests-per-call" in updates[MAX_OPEN][-1].message


@pytest.mark.parametrize("fault", ["duplicate-id", "no-action"])
def test_the_calls_own_fault_fails_it_and_cancels_what_it_had_open(harness, token_ids, fault) -> None:
    harness.script_all(token_ids * 20, delay_s=0.02)
    call = ManyCall(harness)
    call.start(1, pb.GenerateRequest(prompt="long", max_tokens=500, ignore_eos=True))
    first = next(iter(call.call))  # the request runs on a router
    assert first.updates[0].id == 1
    if fault == "duplicate-id":
        call.start(1, pb.GenerateRequest(prompt="again", max_tokens=5))
    else:
        call.send(pb.ManyRequest(id=3))
    with pytest.raises(grpc.RpcError) as raised:
        list(call.call)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("already open" if fault == "duplicate-id" else "generate or cancel") in raised.value.details()
    call.close()
    deadline = time.monotonic() + 10
    while not harness.all_cancelled() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(harness.all_cancelled()) == 1


def test_a_caller_that_cancels_the_call_cancels_its_requests(harness, token_ids) -> None:
    harness.script_all(token_ids * 20, delay_s=0.02)
    call = ManyCall(harness)
    for index in range(3):
        call.start(index, pb.GenerateRequest(prompt=f"long {index}", max_tokens=500, ignore_eos=True))
    started: set[int] = set()
    for message in call.call:
        started.update(u.id for u in message.updates)
        if len(started) == 3:
            break
    call.call.cancel()
    call.close()
    deadline = time.monotonic() + 10
    while len(harness.all_cancelled()) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(harness.all_cancelled()) == 3
    assert not harness.routers[0].state.finished and not harness.routers[1].state.finished


def test_an_idle_call_ends_when_the_caller_half_closes(harness) -> None:
    call = ManyCall(harness)
    call.close()
    assert call.read_all() == []
    assert call.call.code() == grpc.StatusCode.OK


def test_concurrent_writers_of_one_call_are_served(harness, token_ids) -> None:
    """Requests started from several threads at once, closed when all are in."""
    harness.script_all(token_ids)
    call = ManyCall(harness)
    threads = [threading.Thread(target=call.start, args=(i, pb.GenerateRequest(prompt=f"t{i}", max_tokens=9,
                                                                                   ignore_eos=True)))
               for i in range(MAX_OPEN)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    call.close()
    updates = by_request(call.read_all())
    assert sorted(updates) == list(range(MAX_OPEN))
    assert all(got[-1].response.usage.completion_tokens == 9 for got in updates.values())


def test_a_draining_gateway_refuses_new_requests_and_ends_its_calls(tokenizer, token_ids) -> None:
    """An idle call ends with UNAVAILABLE as the drain begins; a request that arrives during the
    drain is refused (UNAVAILABLE); one that outlives the grace gets UNAVAILABLE as its last
    update, and its call ends with UNAVAILABLE."""
    grace_s = 2.0
    with running_harness(tokenizer, num_routers=1, router_class=StreamingFakeRouter,
                         settings={"shutdown_grace_s": grace_s}) as harness:
        harness.script_all(token_ids * 40, delay_s=0.02)
        idle, busy = ManyCall(harness), ManyCall(harness)
        busy.start(1, pb.GenerateRequest(prompt="long", max_tokens=400, ignore_eos=True))
        updates = iter(busy.call)
        first = next(updates).updates[0]
        assert first.id == 1 and not first.code
        stopping = threading.Thread(target=harness.loop.run, args=(harness.gateway.stop(),))
        started = time.monotonic()
        stopping.start()
        try:
            with pytest.raises(grpc.RpcError) as raised:
                idle.read_all()
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < grace_s / 2
            late = ManyCall(harness)  # a call that arrives during the drain is refused
            late.close()
            with pytest.raises(grpc.RpcError) as raised:
                late.read_all()
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            busy.start(2, pb.GenerateRequest(prompt="late", max_tokens=5))
            seen: dict[int, list[pb.ManyUpdate]] = {}
            with pytest.raises(grpc.RpcError) as raised:
                for message in updates:
                    for update in message.updates:
                        seen.setdefault(update.id, []).append(update)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - started < grace_s + 1
            assert seen[2][-1].code == grpc.StatusCode.UNAVAILABLE.value[0]
            assert seen[1][-1].code == grpc.StatusCode.UNAVAILABLE.value[0]
            assert len([t for u in seen[1] for t in u.response.token_ids]) < 400
        finally:
            idle.close()
            busy.close()
            stopping.join(timeout=30)
