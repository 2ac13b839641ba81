"""grpc.health.v1 both ways: the handle a service flips its status with, and the one Check call
that the launcher, the container probe (`radixserve.health_probe`) and tests ask a service with.

It imports grpc only (not torch), so a probe costs a fraction of a second.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from radixserve.security import NO_SECURITY, Security

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# How long one Check may take when the caller does not say.
CHECK_TIMEOUT_S = 1.0


class Health:
    """The grpc.health.v1 servicer plus a one-call way to flip the whole server's status.

    Status is reported both for the overall server ("") and for each named service.
    """

    def __init__(self, service_names: Iterable[str]) -> None:
        self.servicer = health.aio.HealthServicer()
        self._names = ["", *service_names]

    async def set(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in self._names:
            await self.servicer.set(name, status)


def probe(
    address: str, service: str = "", timeout_s: float = CHECK_TIMEOUT_S,
    security: Security = NO_SECURITY,
) -> str:
    """The status name `address` reports for `service` ("" is the whole server), over TLS (and
    with a client certificate) when `security` says so; the health service asks for no token.

    Returns "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN", ... or "UNREACHABLE" (with the gRPC
    status code) when the call itself fails.
    """
    with security.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return f"UNREACHABLE ({exc.code().name})"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def is_serving(
    address: str, timeout_s: float = CHECK_TIMEOUT_S, security: Security = NO_SECURITY
) -> bool:
    """True when the server at `address` answers SERVING for the overall server."""
    return probe(address, "", timeout_s, security) == "SERVING"


async def check_health(
    address: str, timeout_s: float = CHECK_TIMEOUT_S, security: Security = NO_SECURITY
) -> bool:
    """`is_serving` off the event loop."""
    return await asyncio.to_thread(is_serving, address, timeout_s, security)
