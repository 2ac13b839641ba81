"""RouterService.Stream against fake workers: many requests on one call, each step's updates in
one message, the same tokens and statuses as Generate, cancels by message and by the call's end;
and the gateway's side of it (gateway_service/router_stream.py) against the same real router."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import grpc
import pytest

from gateway_service.router_stream import RouterStream
from radixserve import bare_tokens
from radixserve.v1 import generation_pb2, router_pb2
from router.fake_model import EOS_TOKEN_ID, expected_tokens
from router.harness import generate_request, running_router, settled
from router_service.config import RouterConfig
from router_service.core.request import FinishReason, Request
from router_service.events import EventSink, StreamEvent
from router_service.request_stream import RequestStream

EOS_EVERY = 40


def opened(request: router_pb2.RouterGenerateRequest) -> router_pb2.RouterStreamRequest:
    return router_pb2.RouterStreamRequest(open=request)


# Long enough that a request runs far past `settled`'s wait unless it is let go.
LONG = 3000


@pytest.mark.timeout(60)
def test_many_requests_on_one_call_get_generates_tokens_a_step_per_message() -> None:
    async def scenario() -> None:
        config = RouterConfig(max_batch_tokens=64, max_running_requests=16)
        async with running_router([300], config, eos_every=EOS_EVERY, step_delay_s=0.005) as h:
            rng = random.Random(11)
            cases = {f"r{i}": ([rng.randrange(3, 64) for _ in range(rng.randrange(1, 30))], rng.randrange(1, 30),
                               rng.sample(range(3, 64), 3) if i % 3 == 0 else [])
                     for i in range(12)}
            call = h.stub.Stream()
            for request_id, (prompt, max_tokens, stop) in cases.items():
                await call.write(opened(generate_request(prompt, max_tokens, stop_token_ids=stop,
                                                         logprobs=True, request_id=request_id)))
            await call.done_writing()
            tokens = {request_id: [] for request_id in cases}
            last = {}
            sizes = []
            async for message in call:  # ends once every request has (the caller is done writing)
                sizes.append(len(message.updates))
                for update in message.updates:
                    assert update.error_code == 0, update.error_message
                    assert update.request_id not in last, "an update after the request's last"
                    tokens[update.request_id].extend(update.response.token_ids)
                    assert len(update.response.logprobs) == len(update.response.token_ids)
                    if update.response.finish_reason:
                        last[update.request_id] = update.response
            for request_id, (prompt, max_tokens, stop) in cases.items():
                want = expected_tokens(prompt, max_tokens, eos_every=EOS_EVERY, stop_token_ids=frozenset(stop))
                assert tokens[request_id] == want
                ended_by_stop = want[-1] == EOS_TOKEN_ID or want[-1] in stop
                assert last[request_id].finish_reason == (
                    generation_pb2.FINISH_REASON_STOP if ended_by_stop else generation_pb2.FINISH_REASON_LENGTH)
                assert last[request_id].usage.completion_tokens == len(want)
                assert last[request_id].usage.prompt_tokens == len(prompt)
            # Requests that run together come back together: far fewer messages than updates.
            assert max(sizes) >= 8
            assert len(sizes) < sum(sizes) / 3
            await settled(h)
            assert not h.workers[0].errors

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_bare_tokens_and_updates_give_what_updates_alone_give() -> None:
    """A caller that asks for bare tokens: applying each message's bare tokens, then its updates,
    gives every request its tokens in order; first and last tokens, and every token of a request
    with logprobs, come as updates; the last update's usage counts the bare tokens."""

    async def scenario() -> None:
        config = RouterConfig(max_batch_tokens=64, max_running_requests=16)
        async with running_router([300], config, eos_every=EOS_EVERY, step_delay_s=0.002) as h:
            rng = random.Random(12)
            cases = {f"r{i}": ([rng.randrange(3, 64) for _ in range(rng.randrange(1, 30))], rng.randrange(1, 40))
                     for i in range(12)}
            call = h.stub.Stream(metadata=(bare_tokens.METADATA,))
            for index, (request_id, (prompt, max_tokens)) in enumerate(cases.items()):
                await call.write(opened(generate_request(prompt, max_tokens, logprobs=index % 4 == 0,
                                                         request_id=request_id)))
            await call.done_writing()
            tokens: dict[str, list[int]] = {request_id: [] for request_id in cases}
            last = {}
            num_bare = 0
            async for message in call:
                assert len(message.bare_request_ids) == len(message.bare_token_ids)
                for request_id, token_id in zip(message.bare_request_ids, message.bare_token_ids):
                    assert tokens[request_id], "a bare token before the request's first update"
                    assert request_id not in last and int(request_id[1:]) % 4, "bare: a last token, or with logprobs"
                    tokens[request_id].append(token_id)
                    num_bare += 1
                for update in message.updates:
                    assert update.error_code == 0, update.error_message
                    tokens[update.request_id].extend(update.response.token_ids)
                    if update.response.finish_reason:
                        last[update.request_id] = update.response
            for request_id, (prompt, max_tokens) in cases.items():
                want = expected_tokens(prompt, max_tokens, eos_every=EOS_EVERY)
                assert tokens[request_id] == want
                assert last[request_id].usage.completion_tokens == len(want)
                assert last[request_id].usage.prompt_tokens == len(prompt)
            assert num_bare > sum(len(t) for t in tokens.values()) // 3
            await settled(h)
            assert not h.workers[0].errors

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_refusals_are_updates_and_leave_the_call_serving() -> None:
    async def scenario() -> None:
        config = RouterConfig(max_batch_tokens=8, max_running_requests=1, max_queue=1)
        async with running_router([64], config, context_len=64, step_delay_s=0.02) as h:
            call = h.stub.Stream()
            refused = {
                "empty": generate_request([], 5, request_id="empty"),
                "no-tokens": generate_request([3, 4], 0, request_id="no-tokens"),
                "vocab": generate_request([3, 99999], 5, request_id="vocab"),
                "": generate_request([3, 4], 5),
            }
            for request in refused.values():
                await call.write(opened(request))
            # Three that fit: one runs, one waits, the third finds the queue full; then the
            # first one's id again while it is open.
            for i in range(3):
                await call.write(opened(generate_request([3, 4, 5 + i], 10, request_id=f"ok{i}")))
            await call.write(opened(generate_request([3, 4], 3, request_id="ok0")))
            await call.done_writing()
            codes: dict[str, list[int]] = {}
            finished = set()
            async for message in call:
                for update in message.updates:
                    if update.error_code:
                        codes.setdefault(update.request_id, []).append(update.error_code)
                        assert update.error_message
                    elif update.response.finish_reason:
                        finished.add(update.request_id)
            invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
            for request_id in ("empty", "no-tokens", "vocab", ""):
                assert codes[request_id] == [invalid]
            assert codes["ok0"] == [invalid]  # the duplicate; the first ok0 ran to its end
            assert "ok0" in finished
            exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert [codes.get(f"ok{i}") for i in (1, 2)].count([exhausted]) >= 1
            assert len(finished) + sum(codes.get(f"ok{i}") == [exhausted] for i in (1, 2)) == 3
            await settled(h)

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_cancels_by_message_and_by_the_calls_end_give_the_pages_back() -> None:
    async def scenario() -> None:
        config = RouterConfig(max_batch_tokens=64, max_running_requests=20)
        async with running_router([2000], config, step_delay_s=0.005) as h:
            rng = random.Random(5)
            prompts = [[rng.randrange(3, 64) for _ in range(rng.randrange(5, 30))] for _ in range(12)]
            call = h.stub.Stream()
            for index, prompt in enumerate(prompts):
                await call.write(opened(generate_request(prompt, LONG, request_id=f"r{index}")))
            counts = dict.fromkeys(range(12), 0)
            cancelled = set()
            async for message in call:
                for update in message.updates:
                    assert update.error_code == 0 and not update.response.finish_reason
                    index = int(update.request_id[1:])
                    assert index not in cancelled or counts[index] < 5 + 3, "updates long after its cancel"
                    counts[index] += len(update.response.token_ids)
                    if index % 2 and counts[index] >= 5 and index not in cancelled:
                        cancelled.add(index)
                        await call.write(router_pb2.RouterStreamRequest(cancel=update.request_id))
                if len(cancelled) == 6 and min(counts[i] for i in range(0, 12, 2)) >= 10:
                    break
            for _ in range(100):  # the last cancel may still be on its way (or its step in flight)
                running = (await h.stub.GetStats(router_pb2.GetStatsRequest())).num_running
                if running == 6:
                    break
                await asyncio.sleep(0.05)
            assert running == 6  # the cancelled ones left; the rest still run
            call.cancel()  # the call's end cancels the six still open
            stats = await settled(h)
            assert stats.num_pages_free + stats.num_pages_evictable == stats.num_pages_total
            assert not h.workers[0].errors

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_gateway_side_tokens_deadline_early_close_and_router_loss() -> None:
    async def scenario() -> None:
        config = RouterConfig(max_batch_tokens=64, max_running_requests=20)
        async with running_router([2000], config, eos_every=0, step_delay_s=0.01) as h:
            stream = RouterStream(h.stub, ())
            try:
                # Tokens, as Generate would give them, for requests that share the call.
                prompts = [[3 + i, 4, 5, 6] for i in range(4)]

                async def run(index: int) -> list[int]:
                    tokens = []
                    request = generate_request(prompts[index], 6 + index, request_id=f"g{index}")
                    async with contextlib.aclosing(stream.generate(request, None)) as responses:
                        async for response in responses:
                            tokens.extend(response.token_ids)
                    return tokens

                results = await asyncio.gather(*(run(i) for i in range(4)))
                assert results == [expected_tokens(p, 6 + i, eos_every=0) for i, p in enumerate(prompts)]

                # A deadline that passes mid-request: DEADLINE_EXCEEDED, and the router lets it go.
                request = generate_request([3, 4, 5], LONG, request_id="late")
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async with contextlib.aclosing(stream.generate(request, time.monotonic() + 0.3)) as responses:
                        async for _ in responses:
                            pass
                assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                await settled(h)

                # A caller that stops reading early (a stop string): the router lets it go too.
                request = generate_request([3, 4, 6], LONG, request_id="early")
                async with contextlib.aclosing(stream.generate(request, None)) as responses:
                    async for response in responses:
                        if response.token_ids:
                            break
                await settled(h)

                # The router's error for one request fails that request only.
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async with contextlib.aclosing(stream.generate(generate_request([], 3, request_id="bad"), None)) as r:
                        async for _ in r:
                            pass
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert stream.failed is None

                # The call breaking fails what is open on it with its status.
                request = generate_request([3, 4, 7], LONG, request_id="lost")
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async with contextlib.aclosing(stream.generate(request, None)) as responses:
                        async for response in responses:
                            if response.token_ids:
                                stream._call.cancel()  # as if the connection dropped
                assert caught.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                assert stream.failed is not None
                await settled(h)
            finally:
                await stream.close()

    asyncio.run(scenario())


class _OneRequestEngine:
    """What a `RequestStream` uses of the engine, keeping the request and sink it is given."""

    config = RouterConfig()

    def submit(self, request: Request, sink: EventSink) -> None:
        self.request, self.sink = request, sink

    def cancel(self, request: Request) -> None:
        raise AssertionError("nothing is cancelled here")

    def load(self) -> router_pb2.RouterLoad:
        return router_pb2.RouterLoad(num_running=1)


@pytest.mark.timeout(10)
def test_updates_built_at_write_time_report_usage_as_of_their_step() -> None:
    """The call builds its message when it writes, possibly after further steps: each update
    still reports the completion tokens (and finish) of the step that produced it, in order,
    and a refusal keeps its place among the updates."""

    async def scenario() -> router_pb2.RouterStreamResponse:
        engine = _OneRequestEngine()
        stream = RequestStream(engine)  # type: ignore[arg-type]
        stream.open(generate_request([5, 6, 7], 2, request_id="a"))
        request = engine.request
        for token, finish in ((9, None), (10, FinishReason.LENGTH)):  # two steps before a write
            request.token_ids.append(token)
            request.num_output += 1
            request.finish_reason = finish
            engine.sink.put_nowait(StreamEvent([token], finished=finish is not None))
        stream.open(generate_request([5], 2, request_id=""))  # refused: no request_id
        stream.caller_done()
        messages = [message async for message in stream.responses()]
        stream.close()
        assert len(messages) == 1
        return messages[0]

    message = asyncio.run(scenario())
    assert [update.request_id for update in message.updates] == ["a", "a", ""]
    first, last, refused = message.updates
    assert list(first.response.token_ids) == [9] and first.response.usage.completion_tokens == 1
    assert first.response.finish_reason == generation_pb2.FINISH_REASON_UNSPECIFIED
    assert list(last.response.token_ids) == [10] and last.response.usage.completion_tokens == 2
    assert last.response.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert all(update.response.usage.prompt_tokens == 3 for update in (first, last))
    assert refused.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert message.load.num_running == 1


@pytest.mark.timeout(10)
def test_bare_tokens_keep_their_order_behind_an_update_of_the_same_message() -> None:
    """Built at write time, with bare tokens: a request's first token is an update, and so is
    every later one in that message (the caller reads bare tokens first); in the next message
    its tokens go bare up to the last, an update again. A refused duplicate of an open id makes
    that request's later tokens in the message updates too. Plain tokens come as the engine
    hands them over (`put_token`), the last as an event."""

    async def scenario() -> list[router_pb2.RouterStreamResponse]:
        engine = _OneRequestEngine()
        stream = RequestStream(engine, bare_tokens=True)  # type: ignore[arg-type]
        stream.open(generate_request([5, 6, 7], 6, request_id="a"))
        request = engine.request
        messages = []
        responses = stream.responses()
        await anext(responses)  # the load, before any request's update

        def step(token: int, finish: FinishReason | None = None) -> None:
            request.token_ids.append(token)
            request.num_output += 1
            request.finish_reason = finish
            if finish is None:
                engine.sink.put_token(token)
            else:
                engine.sink.put_nowait(StreamEvent([token], finished=finish is not None))

        step(9)
        step(10)
        messages.append(await anext(responses))
        step(11)
        stream.open(generate_request([5], 2, request_id="a"))  # refused: "a" is open
        step(12)
        messages.append(await anext(responses))
        step(13)
        step(14, FinishReason.LENGTH)
        stream.caller_done()
        messages.extend([message async for message in responses])
        stream.close()
        return messages

    first, second, third = asyncio.run(scenario())
    assert not first.bare_request_ids
    assert [list(u.response.token_ids) for u in first.updates] == [[9], [10]]
    assert list(second.bare_token_ids) == [11] and list(second.bare_request_ids) == ["a"]
    assert [u.error_code != 0 for u in second.updates] == [True, False]
    assert list(second.updates[1].response.token_ids) == [12]
    assert second.updates[1].response.usage.completion_tokens == 4
    assert list(third.bare_token_ids) == [13]
    (final,) = third.updates
    assert list(final.response.token_ids) == [14] and final.response.usage.completion_tokens == 6
    assert final.response.finish_reason == generation_pb2.FINISH_REASON_LENGTH
