"""A running router: the engine loop, the RouterService gRPC server and /metrics (started and
stopped by `radixserve.serving.run_service`).

Health is NOT_SERVING until every rank answered, and follows the engine's view of the workers
after that. The engine keeps stepping through the shutdown grace period, so in-flight streams
can finish. An engine loop that ends on its own is a bug: the router goes NOT_SERVING and the
process exits 1, since a router that cannot step must not look alive.
"""

from __future__ import annotations

import asyncio
import logging

from radixserve.heap import freeze_startup_heap
from radixserve.health import Health
from radixserve.metrics import serve_metrics
from radixserve.security import Security, load_security
from radixserve.serving import start_server
from radixserve.v1 import router_pb2, router_pb2_grpc
from router_service.config import RouterConfig
from router_service.engine import Engine
from router_service.service import RouterService

log = logging.getLogger(__name__)

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


class Router:
    def __init__(self, config: RouterConfig, security: Security) -> None:
        self.config = config
        self.crashed = asyncio.Event()
        self.engine = Engine(config, self._on_health, security)
        self.port = 0
        self._health: Health | None = None
        self._server = None
        self._metrics = None
        self._engine_stop = asyncio.Event()
        self._engine_task: asyncio.Task | None = None

    @classmethod
    async def start(cls, config: RouterConfig) -> "Router":
        """Serve at once (NOT_SERVING) and start the engine loop, which connects to the workers."""
        security = load_security(config.security)
        router = cls(config, security)
        servicer = RouterService(router.engine)
        router._metrics = serve_metrics(router.engine.metrics.registry, config.host,
                                        config.metrics_port, "router")
        router._server, router._health, router.port = await start_server(
            config.host, config.port,
            [lambda server: router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)],
            [SERVICE_NAME], security=security,
        )
        log.info("router listening on %s:%d, workers %s", config.host, router.port,
                 ",".join(config.workers))
        freeze_startup_heap("router")
        router._engine_task = asyncio.create_task(router.engine.run(router._engine_stop))
        router._engine_task.add_done_callback(router._engine_ended)
        return router

    async def _on_health(self, serving: bool) -> None:
        if self._health is not None:
            await self._health.set(serving)

    def _engine_ended(self, task: asyncio.Task) -> None:
        if self._engine_stop.is_set():
            return
        error = None if task.cancelled() else task.exception()
        log.critical("the engine loop ended unexpectedly; stopping the router", exc_info=error)
        self.crashed.set()

    async def stop(self) -> None:
        """In-flight streams get `shutdown_grace_s` while the engine still steps; then it stops.
        After a crash: NOT_SERVING and stop at once."""
        assert self._server is not None and self._health is not None
        if self.crashed.is_set():
            await self._health.set(False)
            await self._server.stop(0)
        else:
            await self._server.stop(self.config.shutdown_grace_s)
            self._engine_stop.set()
            await self._engine_task
        if self._metrics is not None:
            self._metrics.stop()
