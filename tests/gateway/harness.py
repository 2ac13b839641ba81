"""An in-process gateway in front of fake routers, on 127.0.0.1, for gateway and client tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from gateway.background import BackgroundLoop
from gateway.fake_router import FakeRouter
from gateway_service.config import GatewayConfig
from gateway_service.openai_api.app import TokenCheck
from gateway_service.server import Gateway
from gateway_service.tokenizer import Tokenizer
from procs import free_port
from radixserve import constraints
from radixserve.constraints import Constraint
from radixserve.v1 import generation_pb2, generation_pb2_grpc, router_pb2

CONTEXT_LEN = 512
VOCAB_SIZE = 49152
EOS_TOKEN_ID = 2


def server_info() -> router_pb2.GetServerInfoResponse:
    model = generation_pb2.GetModelInfoResponse(
        model_name="fake-smollm2", context_len=CONTEXT_LEN, tp_size=1, page_size=16,
        dtype="float32", num_pages=128,
    )
    return router_pb2.GetServerInfoResponse(model=model, eos_token_ids=[EOS_TOKEN_ID],
                                            vocab_size=VOCAB_SIZE)


@dataclass
class GatewayHarness:
    loop: BackgroundLoop
    routers: list[FakeRouter]
    gateway: Gateway
    channel: grpc.Channel
    stub: generation_pb2_grpc.GenerationServiceStub

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    def script_all(self, token_ids: list[int], **settings) -> None:
        for router in self.routers:
            router.script(token_ids, **settings)

    def all_requests(self) -> list[router_pb2.RouterGenerateRequest]:
        return [r for router in self.routers for r in router.state.requests]

    def sent_constraint(self) -> Constraint | None:
        """The constraint the last request routed carried (None: none)."""
        return constraints.from_proto(self.all_requests()[-1].constraint)

    def all_cancelled(self) -> list[str]:
        return [r for router in self.routers for r in router.state.cancelled]

    def reprobe(self) -> None:
        self.loop.run(self.gateway.probe_once())


def start_harness(
    tokenizer: Tokenizer, num_routers: int = 2, with_http: bool = False,
    token_check: TokenCheck | None = None, router_class: type[FakeRouter] = FakeRouter,
    settings: dict | None = None,
) -> GatewayHarness:
    """`with_http`: also the OpenAI-compatible HTTP API on a free port (`gateway.http.port`);
    `router_class`: the fake routers' kind (`FakeRouter` or a subclass); `settings`: more
    GatewayConfig fields."""
    loop = BackgroundLoop()
    routers = [router_class(server_info()) for _ in range(num_routers)]
    for router in routers:
        loop.run(router.start())
    config = GatewayConfig(
        host="127.0.0.1", port=0, routers=tuple(r.address for r in routers),
        default_max_tokens=64, affinity_tokens=16, probe_interval_s=0.5,
        http_port=free_port() if with_http else 0, metrics_port=0, **(settings or {}),
    )
    gateway = loop.run(Gateway.start(config, tokenizer=tokenizer, token_check=token_check))
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.port}")
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    return GatewayHarness(loop, routers, gateway, channel, stub)


@contextlib.contextmanager
def running_harness(tokenizer: Tokenizer, **options) -> Iterator[GatewayHarness]:
    """`start_harness(tokenizer, **options)`, stopped on exit."""
    running = start_harness(tokenizer, **options)
    try:
        yield running
    finally:
        stop_harness(running)


def stop_harness(harness: GatewayHarness) -> None:
    harness.channel.close()
    harness.loop.run(harness.gateway.stop())
    for router in harness.routers:
        harness.loop.run(router.stop())
    harness.loop.close()


def stream_summary(chunks: list[generation_pb2.GenerateResponse]) -> dict:
    """What a caller reads from a stream's chunks, whatever their boundaries."""
    return {
        "text": "".join(chunk.text for chunk in chunks),
        "token_ids": [t for chunk in chunks for t in chunk.token_ids],
        "logprobs": [(lp.token_id, lp.token, lp.logprob, [(t.token_id, t.token, t.logprob) for t in lp.top_logprobs])
                     for chunk in chunks for lp in chunk.logprobs],
        "finish_reason": chunks[-1].finish_reason,
        "usage": (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens),
    }
