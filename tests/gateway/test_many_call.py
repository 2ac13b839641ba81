"""GenerateMany's call in one process (gateway_service/many_call.py), with a `generate` of the
test's own: a cancel read before its request ran is that request's last update, a caller that
does not read stops being read, a large outbox goes out in bounded messages in order, and the
chunks a router message hands over (by a lane and by the tasks it woke) share one message.
Over gRPC against fake routers: test_generate_many.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from gateway_service import many_call
from gateway_service.caller import Caller
from gateway_service.errors import InvalidRequest
from radixserve.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(60)


def test_a_cancel_before_the_request_ran_is_its_last_update() -> None:
    """Every start is cancelled before the loop runs its task (over gRPC, with the order less
    certain: test_generate_many.py's cancel right behind its start)."""
    async def slow(request, caller, sink):
        while True:
            await asyncio.sleep(0.01)
            yield pb.GenerateResponse(text="x")

    async def requests():
        for index in range(5):
            yield pb.ManyRequest(id=index, generate=pb.GenerateRequest(prompt="x"))
            yield pb.ManyRequest(id=index, cancel=True)

    async def scenario() -> list[tuple[int, int]]:
        call = many_call.ManyCall(slow, lambda request, index: Caller(str(index)), 8, lambda: False)
        messages = [message async for message in call.responses(requests())]
        return [(update.id, update.code) for message in messages for update in message.updates]

    cancelled = grpc.StatusCode.CANCELLED.value[0]
    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == [(index, cancelled) for index in range(5)]


def test_a_caller_that_does_not_read_is_not_read_either(monkeypatch) -> None:
    """Requests that fail at once make an update each; with nobody taking the updates the call
    stops reading requests at MAX_WAITING_UPDATES, and goes on once the writer takes them."""
    monkeypatch.setattr(many_call, "MAX_WAITING_UPDATES", 50)
    pulled = 0

    async def refuse(request, caller, sink):
        raise InvalidRequest("refused")
        yield  # an async generator, as the servicer's generate

    async def requests():
        nonlocal pulled
        for index in range(10_000):
            pulled += 1
            yield pb.ManyRequest(id=index, generate=pb.GenerateRequest(prompt="x"))

    async def scenario() -> tuple[int, int, int]:
        call = many_call.ManyCall(refuse, lambda request, index: Caller(str(index)), 8, lambda: False)
        responses = call.responses(requests())
        first = await anext(responses)
        await asyncio.sleep(0.2)  # the reader runs on while nothing takes the updates
        pulled_while_unread = pulled
        updates = len(first.updates) + sum([len(message.updates) async for message in responses])
        return pulled_while_unread, updates, pulled

    while_unread, updates, total = asyncio.run(scenario())
    # The first message took what came before it; then the outbox filled to the bound and stayed.
    assert while_unread <= 3 * 50
    assert total == updates == 10_000


def test_a_large_outbox_goes_out_in_bounded_messages_in_order() -> None:
    """More updates than a message holds (MAX_UPDATES_PER_MESSAGE), and chunks past the byte
    bound, split over several messages, every update once and in order; wake-ups send nothing."""
    small = [(i, pb.GenerateResponse(text="x", token_ids=[i]), None) for i in range(600)]
    big = pb.GenerateResponse(text="y" * many_call.MAX_MESSAGE_BYTES)  # past the bound alone
    items = [None, *small, None, (700, big, None), (701, big, None), (702, None, (grpc.StatusCode.CANCELLED, "c"))]
    messages = many_call._messages(items)
    assert [len(m.updates) for m in messages] == [many_call.MAX_UPDATES_PER_MESSAGE, 600 - 512 + 1, 1, 1]
    ids = [u.id for m in messages for u in m.updates]
    assert ids == [*range(600), 700, 701, 702]
    assert messages[-1].updates[-1].code == grpc.StatusCode.CANCELLED.value[0]
    assert many_call._messages([None, None]) == []


def test_a_lanes_chunks_and_the_chunks_of_tasks_woken_with_them_share_one_message() -> None:
    """As a router message's reader does: request 0's plain token goes by its lane (the sink),
    which wakes the writer, and in the same callback request 1's task is woken with an update.
    Both go out in one message, not the lane's alone and then the task's."""
    sinks: dict[int, Callable] = {}
    wake: dict[int, asyncio.Future] = {}

    async def generate(request, caller, sink):
        index = int(caller.request_id)
        sinks[index] = sink
        wake[index] = asyncio.get_running_loop().create_future()
        yield pb.GenerateResponse(text=f"first {index}")
        await wake[index]
        yield pb.GenerateResponse(text=f"woken {index}")

    async def requests():
        for index in range(2):
            yield pb.ManyRequest(id=index, generate=pb.GenerateRequest(prompt="x"))

    async def scenario() -> list[list[tuple[int, str]]]:
        call = many_call.ManyCall(generate, lambda request, index: Caller(str(index)), 8, lambda: False)
        responses = call.responses(requests())
        seen: list[list[tuple[int, str]]] = []
        while sum(len(message) for message in seen) < 2:  # the first chunks, in one message or two
            seen.append([(u.id, u.response.text) for u in (await anext(responses)).updates])

        def router_message() -> None:
            sinks[0](pb.GenerateResponse(text="lane 0"))
            wake[1].set_result(None)
        asyncio.get_running_loop().call_soon(router_message)
        message = await anext(responses)
        wake[0].set_result(None)
        await responses.aclose()
        return [(u.id, u.response.text) for u in message.updates]

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == [(0, "lane 0"), (1, "woken 1")]
