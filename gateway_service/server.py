"""A running gateway: the gRPC server, the HTTP API, its router pool, and the probe loop that
drives health (started and stopped by `radixserve.serving.run_service`).

The public gRPC and HTTP ports are listened on once the tokenizer is loaded and the constraint
compile processes are up: the host's gateways share them (`radixserve up --gateways N`), and the
kernel hands a listening process its share of new connections, ready or not. Health is
NOT_SERVING until at least one router answers GetServerInfo, and again while none does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from gateway_service import compile_processes
from gateway_service.chat_format import ChatFormat
from gateway_service.config import GatewayConfig
from gateway_service.constraint_check import ConstraintChecker
from gateway_service.openai_api.app import TokenCheck, build_app
from gateway_service.openai_api.server import ConnectionLimits, HttpServer
from gateway_service.prefix_memory import PrefixMemory
from gateway_service.router_choice import RouterPool
from gateway_service.router_discovery import RouterDiscovery
from gateway_service.service import GenerationServicer
from gateway_service.pooling_config import load_pooling
from gateway_service.tokenizer import Tokenizer
from radixserve.heap import freeze_startup_heap
from radixserve.guard import token_accepted
from radixserve.metrics import MetricsServer, serve_metrics
from radixserve.security import load_security
from radixserve.health import Health
from radixserve.serving import build_server, check_can_listen, listen
from radixserve.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
# The end of the drain's grace kept for ending the streams still open (error event or status)
# and closing the servers: at most this, and at most a quarter of the grace.
END_STREAMS_S = 1.0
MS = 1000


def public_grpc_options(config: GatewayConfig) -> list[tuple[str, int]]:
    """The public gRPC port's connection limits (the HTTP API's are `ConnectionLimits`)."""
    return [
        ("grpc.server_handshake_timeout_ms", int(config.http_header_timeout_s * MS)),
        ("grpc.max_connection_idle_ms", int(config.grpc_idle_timeout_s * MS)),
        ("grpc.max_concurrent_streams", config.grpc_max_streams),
        # grpc's "overload protection" (on by default) counts a finished call against the limit
        # until the Python server has freed it, and refuses new streams past it (RST_STREAM
        # REFUSED_STREAM: UNAVAILABLE at the caller) although the client keeps to the limit; on
        # a busy gateway that was 17 of 120 calls at 40 concurrent on one channel with the limit
        # at 8. Off, the limit is HTTP/2's, which grpc clients keep by queueing the calls past it.
        ("grpc.http.overload_protection", 0),
        ("grpc.max_allowed_incoming_connections", config.max_connections),
    ]


class Gateway:
    def __init__(
        self, config: GatewayConfig, server: grpc.aio.Server, health: Health, port: int,
        pool: RouterPool, servicer: GenerationServicer, discovery: RouterDiscovery | None = None,
    ) -> None:
        self.config = config
        self.discovery = discovery
        self.port = port
        self.pool = pool
        self.servicer = servicer
        self._server = server
        self._health = health
        self._serving: bool | None = None
        self._heap_frozen = False  # radixserve.heap: once serving first
        self._probing: asyncio.Task | None = None
        # Set when a background task died: the process should stop (see `run_service`).
        self.crashed = asyncio.Event()
        self.http: HttpServer | None = None
        self.metrics: MetricsServer | None = None

    @classmethod
    async def start(
        cls, config: GatewayConfig, tokenizer: Tokenizer | None = None,
        token_check: TokenCheck | None = None,
    ) -> "Gateway":
        """Load the tokenizer (unless given) off the event loop, start the compile processes,
        probe the routers, then listen (/metrics at once). A public port that cannot be listened
        on is `CannotListen` before the loading.

        The HTTP API's `/v1/` routes answer 401 without a token the gRPC API accepts too
        (`token_check` replaces that check, for tests). Raises `SecurityError` when a TLS or
        token file cannot be used.
        """
        security = load_security(config.security, public=True)
        if token_check is None and security.accepted_tokens:
            accepted = tuple(token.encode() for token in security.accepted_tokens)
            token_check = lambda presented: token_accepted(presented, accepted)  # noqa: E731
        discovery = RouterDiscovery(config.routers, config.router_dns, config.router_dns_interval_s)
        memory = (PrefixMemory(config.prefix_memory_entries, config.prefix_memory_stride, config.prefix_memory_holders)
                  if config.prefix_memory_entries else None)
        pool = RouterPool(await discovery.addresses(), config.affinity_tokens, config.probe_timeout_s, security,
                          bounds=config.bounds, memory=memory, tls_name=discovery.tls_name)
        servicer = GenerationServicer(config, pool)
        server, health = await build_server(
            [lambda s: generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, s)],
            [SERVICE_NAME],
            security=security,
            max_receive_bytes=config.limits.max_request_bytes,
            extra_options=public_grpc_options(config),
            share_port=True,  # `radixserve up --gateways N`: one port, N processes
        )
        # The public ports are shared with the host's other gateways, and a port listened on takes
        # connections: they are listened on once this gateway can serve them (below). Whether they
        # can be is known now.
        for port in (config.port, config.http_port):
            check_can_listen(config.host, port)
        gateway = cls(config, server, health, 0, pool, servicer, discovery)
        gateway.metrics = serve_metrics(servicer.metrics.registry, config.host, config.metrics_port, "gateway")
        forkserver = asyncio.create_task(compile_processes.warm_up())
        if tokenizer is None:
            tokenizer = await asyncio.to_thread(Tokenizer.load, config.model)
            log.info("tokenizer loaded from %s", config.model)
        servicer.chat = ChatFormat.detect(tokenizer, config.tool_call_parser, config.reasoning_parser)
        servicer.pooling = pooling = load_pooling(config.model)
        log.info("embeddings: %s", pooling.problem or f"{pooling.mode_name}, normalize={pooling.pooling.normalize} "
                 f"({pooling.source})")
        chat = servicer.chat
        log.info("chat format: %s tool calls, reasoning split %s, template renders tools: %s",
                 chat.tool_parser.name, chat.reasoning or "off", chat.renders_tools)
        await forkserver
        checker = ConstraintChecker(
            tokenizer.hf, config.constraint_timeout_s, config.constraint_cache_size,
            config.constraint_processes, config.constraint_compiles_per_client,
            config.max_constraint_chars, config.constraint_start_timeout_s,
        )
        await checker.start()
        log.info("%d constraint compile processes ready", config.constraint_processes)
        servicer.tokenizer = tokenizer
        servicer.constraints = checker
        await gateway.probe_once()  # health before the first call can ask
        gateway.port = await listen(server, config.host, config.port, security)
        log.info("gateway listening on %s:%d", config.host, gateway.port)
        await gateway._start_http(token_check)
        gateway._probing = asyncio.create_task(gateway._probe_loop())
        gateway._probing.add_done_callback(gateway._probe_loop_ended)
        return gateway

    async def _start_http(self, token_check: TokenCheck | None) -> None:
        """The OpenAI-compatible HTTP API, when its port is not 0."""
        config = self.config
        if config.http_port:
            app = build_app(self.servicer, config.max_choices, lambda: bool(self._serving), config.limits,
                            token_check)
            limits = ConnectionLimits(config.http_header_timeout_s, config.http_keep_alive_s,
                                      config.max_connections, config.limits.max_request_bytes)
            self.http = await HttpServer.start(
                app, config.host, config.http_port, config.log_level, limits,
                tls_cert=config.security.tls_cert, tls_key=config.security.tls_key)

    async def probe_once(self) -> bool:
        """Take in the routers discovery found, probe every router and update health; True when
        serving."""
        if self.discovery is not None and self.discovery.dynamic:
            self.pool.set_addresses(await self.discovery.addresses())
        up = await self.pool.probe_all()
        serving = up and self.servicer.tokenizer is not None
        if serving and not self._heap_frozen:  # the tokenizer has loaded
            freeze_startup_heap("gateway")
            self._heap_frozen = True
        if serving != self._serving:
            self._serving = serving
            await self._health.set(serving)
            log.info("health: %s", "SERVING" if serving else "NOT_SERVING (no router answers)")
        return serving

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            await self.probe_once()

    def _probe_loop_ended(self, task: asyncio.Task) -> None:
        """The probe loop only ends by `stop`; any other end is a bug that would freeze health."""
        if task.cancelled():
            return
        log.critical("the router probe loop died; the gateway stops", exc_info=task.exception())
        self.crashed.set()

    async def stop(self) -> None:
        """Drain: NOT_SERVING at once, new calls refused, in-flight streams get
        `shutdown_grace_s` to finish; those still open near its end are ended with the API's
        error (gRPC UNAVAILABLE; HTTP an error event and `[DONE]`), so that both servers have
        closed when the grace ends; then the router channels close."""
        log.info("stopping: draining in-flight streams for up to %gs", self.config.shutdown_grace_s)
        self.servicer.draining = True
        self._serving = False  # the HTTP API's /health follows too
        await self._health.set(False)
        if self._probing is not None:
            self._probing.cancel()
            # A loop that died has been logged already (`_probe_loop_ended`).
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._probing
        # The servers keep accepting while in-flight streams finish, so a call that arrives
        # now is refused by the servicer with UNAVAILABLE (retry elsewhere); a gRPC server
        # that is stopping would cancel it instead. Both APIs share one grace period.
        grace_s = self.config.shutdown_grace_s
        drain_until = time.monotonic() + grace_s
        ending_s = min(END_STREAMS_S, grace_s / 4)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.servicer.wait_idle(), grace_s - ending_s)
        self.servicer.end_streams()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.servicer.wait_idle(), ending_s / 2)
        left_s = max(0.0, drain_until - time.monotonic())
        stopping = [self._server.stop(left_s)]
        if self.http is not None:
            stopping.append(self.http.stop(left_s))
        await asyncio.gather(*stopping)
        log.info("servers closed %.2fs into the grace period", grace_s - (drain_until - time.monotonic()))
        if self.metrics is not None:
            self.metrics.stop()
        if self.servicer.constraints is not None:
            await self.servicer.constraints.close()
        await self.pool.close()
        self.servicer.close()
        log.info("stopped %.2fs into the grace period", grace_s - (drain_until - time.monotonic()))
