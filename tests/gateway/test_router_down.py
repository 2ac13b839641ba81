"""Routers that are really gone (server stopped): requests fail over, health follows."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.harness import EOS_TOKEN_ID, start_harness, stop_harness
from radixserve.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(60)


def health_status(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def test_stopped_router_fails_over_then_health_goes_not_serving(tokenizer):
    harness = start_harness(tokenizer, num_routers=2)
    try:
        harness.script_all([11, EOS_TOKEN_ID])
        down, alive = harness.routers
        harness.loop.run(down.stop())
        for i in range(8):  # some of these prefer the stopped router
            responses = list(harness.stub.Generate(pb.GenerateRequest(prompt=f"prompt {i}"), timeout=10))
            assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
        assert len(alive.state.finished) == 8
        harness.reprobe()
        assert health_status(harness.channel) == health_pb2.HealthCheckResponse.SERVING
        harness.loop.run(alive.stop())
        harness.reprobe()
        assert health_status(harness.channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            list(harness.stub.Generate(pb.GenerateRequest(prompt="anyone?"), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stop_harness(harness)


def test_a_dead_probe_loop_is_reported_as_a_crash(tokenizer):
    harness = start_harness(tokenizer, num_routers=1)
    try:
        assert not harness.gateway.crashed.is_set()

        async def broken_probe() -> bool:
            raise RuntimeError("bug in probing")

        harness.gateway.probe_once = broken_probe  # the loop calls it every 0.5 s

        async def crashed_within(timeout_s: float) -> bool:
            try:
                await asyncio.wait_for(harness.gateway.crashed.wait(), timeout_s)
            except TimeoutError:
                return False
            return True

        assert harness.loop.run(crashed_within(5.0))
    finally:
        stop_harness(harness)
