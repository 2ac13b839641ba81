"""gRPC server plumbing shared by the services: health, reflection, the guard (TLS, tokens,
strict decoding) and graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from radixserve.guard import Guard
from radixserve.security import Security

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# Internal messages up to 64 MiB: a long prompt's token ids or a large batch fit comfortably.
# The gateway's public port receives far less (its --max-request-bytes).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Keepalive pings every 10 s, answered within 5 s, even with no call open: a peer behind a
# silent partition (no RST, no FIN) is noticed within ~15-20 s instead of the OS's hours.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
# Servers accept pings this often (gRPC's default of 5 minutes would call ours abusive).
MIN_PING_INTERVAL_MS = 5_000
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.min_time_between_pings_ms", MIN_PING_INTERVAL_MS),
]
NO_SECURITY = Security()


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


async def start_server(
    host: str,
    port: int,
    register: Iterable,
    service_names: Iterable[str],
    security: Security = NO_SECURITY,
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
) -> tuple[grpc.aio.Server, Health, int]:
    """Start a grpc.aio server with health (NOT_SERVING at first) and reflection.

    `register` holds callables `f(server)` that add the service's servicers. The port uses TLS
    when `security` has server credentials, and every call but health checks needs one of its
    accepted tokens when it has any. Requests over `max_receive_bytes` are refused by gRPC
    (RESOURCE_EXHAUSTED) before they are read whole. Returns the server, its health handle and
    the bound port (useful when `port` is 0).
    """
    names = list(service_names)
    options = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
    options.append(("grpc.max_receive_message_length", max_receive_bytes))
    server = grpc.aio.server(options=options, interceptors=[Guard(security.accepted_tokens)])
    for add in register:
        add(server)
    health_handle = Health(names)
    health_pb2_grpc.add_HealthServicer_to_server(health_handle.servicer, server)
    await health_handle.set(False)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if security.server_credentials is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", security.server_credentials)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    return server, health_handle, bound


def install_stop_handlers(stop: asyncio.Event) -> None:
    """Set `stop` on SIGINT or SIGTERM, so the service can drain and exit cleanly."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def check_health(address: str, timeout_s: float, security: Security = NO_SECURITY) -> bool:
    """True when the server at `address` answers SERVING for the overall server."""
    async with security.aio_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == SERVING
