"""--grpc-max-streams bounds the calls open on one connection as HTTP/2 does: a client with more
calls than that on one channel has them queued by its own transport (the gateway never runs more
than the limit at once), and every one is served;
none is refused with UNAVAILABLE (RST_STREAM REFUSED_STREAM), which grpc's "overload protection"
did while finished calls were still being freed by the gateway (see `public_grpc_options`)."""

from __future__ import annotations

import collections
import threading

import grpc
import pytest

from gateway.fake_stream_router import StreamingFakeRouter
from gateway.harness import running_harness
from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc

pytestmark = pytest.mark.timeout(60)
MAX_STREAMS = 8
CALLS = 40  # at once, on one channel
MAX_TOKENS = 20


def test_calls_past_the_limit_on_one_channel_wait_and_are_all_served(tokenizer) -> None:
    token_ids = tokenizer.encode_prompt("calls past the limit wait for a free stream", add_special_tokens=False)
    with running_harness(tokenizer, num_routers=1, router_class=StreamingFakeRouter,
                         settings={"grpc_max_streams": MAX_STREAMS}) as harness:
        harness.script_all(token_ids * 5, delay_s=0.01)
        outcomes: collections.Counter[str] = collections.Counter()
        with grpc.insecure_channel(harness.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)

            def call(index: int) -> None:
                request = pb.GenerateRequest(prompt=f"call {index}", max_tokens=MAX_TOKENS, ignore_eos=True)
                try:
                    chunks = list(stub.Generate(request, timeout=30))
                    outcomes[f"{sum(len(chunk.token_ids) for chunk in chunks)} tokens"] += 1
                except grpc.RpcError as exc:
                    outcomes[f"{exc.code().name}: {exc.details()}"] += 1

            most_open = 0
            done = threading.Event()

            def watch() -> None:  # the gateway's Generate calls in flight, polled
                nonlocal most_open
                in_flight = harness.gateway.servicer._in_flight  # noqa: SLF001
                while not done.wait(0.002):
                    most_open = max(most_open, len(in_flight))

            watcher = threading.Thread(target=watch)
            watcher.start()
            threads = [threading.Thread(target=call, args=(index,)) for index in range(CALLS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=50)
            done.set()
            watcher.join()
        assert dict(outcomes) == {f"{MAX_TOKENS} tokens": CALLS}
        assert MAX_STREAMS - 2 <= most_open <= MAX_STREAMS
