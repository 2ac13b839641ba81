"""What the three services share to run: one startup pattern (config -> core -> server ->
serve until a signal), and the gRPC server every one of them gets (health, reflection, the
guard for TLS, tokens and strict decoding, keepalive, message limits).

    python -m router_service  ->  run_service(PROGRAM, Router.start)

`run_service` builds the config from flags and environment, sets up logging, calls the
service's `start(config)` (which builds its core and starts its servers, health NOT_SERVING
until ready) and waits for SIGINT/SIGTERM, then calls `stop()` (each service drains in its own
way) and exits 0; a service whose background task dies sets `crashed`, which stops it too and
exits 1. A start refused for its input (credentials, a model that is missing or unreadable)
exits with that one line, not a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from radixserve.flags import Program
from radixserve.guard import Guard
from radixserve.health import Health
from radixserve.log_format import setup_logging
from radixserve.metrics import CannotListen
from radixserve.model_source import ModelNotFound, ModelUnreadable
from radixserve.security import NO_SECURITY, Security, SecurityError

log = logging.getLogger(__name__)

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
# `start(config)` returns the running service: its `crashed` event is set when a background task
# died, and `await stop()` goes NOT_SERVING, drains what is in flight and releases everything.
Start = Callable[[Any], Awaitable[Any]]


async def start_server(
    host: str, port: int, register: Iterable, service_names: Iterable[str], security: Security = NO_SECURITY,
    **options: Any,
) -> tuple[grpc.aio.Server, Health, int]:
    """`build_server(register, service_names, security, **options)` listening on host:port
    (`listen`). Returns the server, its health handle and the bound port (useful when `port` is 0)."""
    server, health_handle = await build_server(register, service_names, security, **options)
    return server, health_handle, await listen(server, host, port, security)


async def build_server(
    register: Iterable,
    service_names: Iterable[str],
    security: Security = NO_SECURITY,
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
    extra_options: Iterable[tuple[str, Any]] = (),
    share_port: bool = False,
) -> tuple[grpc.aio.Server, Health]:
    """A grpc.aio server with health (NOT_SERVING at first) and reflection, not yet listening.

    `register` holds callables `f(server)` that add the service's servicers. Every call but
    health checks needs one of `security`'s accepted tokens when it has any. Requests over
    `max_receive_bytes` are refused by gRPC (RESOURCE_EXHAUSTED) before they are read whole.
    `extra_options` are further gRPC server arguments (a public port's connection limits). With
    `share_port` (the gateways of one host) other processes may listen on the same port
    (SO_REUSEPORT); otherwise a port something already listens on is an OSError, never a port
    shared with a stranger that would get half the connections (gRPC's default).
    """
    names = list(service_names)
    options = [o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
    options.append(("grpc.max_receive_message_length", max_receive_bytes))
    options.extend(extra_options)
    options.append(("grpc.so_reuseport", int(share_port)))
    server = grpc.aio.server(options=options, interceptors=[Guard(security.accepted_tokens)])
    for add in register:
        add(server)
    health_handle = Health(names)
    health_pb2_grpc.add_HealthServicer_to_server(health_handle.servicer, server)
    await health_handle.set(False)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return server, health_handle


async def listen(server: grpc.aio.Server, host: str, port: int, security: Security = NO_SECURITY) -> int:
    """Listen on host:port (TLS when `security` has server credentials) and start `server`;
    returns the bound port. gRPC listens as the port is added: a server whose port is shared
    takes connections from then on, so one that is not ready yet adds it later."""
    try:  # grpc.aio raises RuntimeError where the sync server returns 0
        if security.server_credentials is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", security.server_credentials)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise CannotListen(f"cannot listen on {host}:{port} (is another process listening there?)")
    await server.start()
    return bound


def check_can_listen(host: str, port: int) -> None:
    """Raise `CannotListen` now where a server sharing `port` (SO_REUSEPORT) could not listen
    on it later: something holds it without sharing, or another user does. Port 0 always can."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise CannotListen(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None


def run_service(program: Program, start: Start, argv: list[str] | None = None) -> None:
    """A service's `main`: config from flags and environment, then `serve_until` a signal."""
    config = program.parse(argv)
    setup_logging(config.log_level, config.log_format)
    try:
        status = asyncio.run(serve_until_signal(start, config))
    except (SecurityError, ModelNotFound, ModelUnreadable, CannotListen) as exc:  # the input, not the code
        raise SystemExit(f"{program.prog}: {exc}") from None
    raise SystemExit(status)


async def serve_until_signal(start: Start, config: Any) -> int:
    stop = asyncio.Event()
    install_stop_handlers(stop)
    return await serve_until(start, config, stop)


async def serve_until(start: Start, config: Any, stop: asyncio.Event) -> int:
    """Start the service and run it until `stop` is set (0) or it crashes (1); then stop it."""
    running = await start(config)
    stopping = asyncio.ensure_future(stop.wait())
    crashed = asyncio.ensure_future(running.crashed.wait())
    await asyncio.wait([stopping, crashed], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    crashed.cancel()
    await running.stop()
    return 1 if running.crashed.is_set() else 0


def install_stop_handlers(stop: asyncio.Event) -> None:
    """Set `stop` on SIGINT or SIGTERM, so the service can drain and exit cleanly."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
