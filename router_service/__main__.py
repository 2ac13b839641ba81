"""`python -m router_service`: serve the router until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from radixserve.metrics import serve_metrics
from radixserve.security import SecurityError, load_security
from radixserve.serving import install_stop_handlers, start_server
from radixserve.v1 import router_pb2, router_pb2_grpc
from router_service.config import RouterConfig, config_from_args
from router_service.engine import Engine
from router_service.service import RouterService

log = logging.getLogger("router_service")

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name
# Seconds in-flight calls get to finish when the router stops.
SHUTDOWN_GRACE_S = 5.0


class EngineCrashed(Exception):
    """The engine loop ended while the router was meant to serve (a bug; it is logged)."""


async def serve(config: RouterConfig, stop: asyncio.Event) -> None:
    """Run the router until `stop` is set. Health is NOT_SERVING until every rank answered.

    Raises `EngineCrashed` (after going NOT_SERVING and stopping the server) when the engine
    loop dies on its own: a router that cannot step must not look alive.
    """
    health_handle = None
    security = load_security(config.security)

    async def on_health(serving: bool) -> None:
        if health_handle is not None:
            await health_handle.set(serving)

    engine = Engine(config, on_health, security)
    servicer = RouterService(engine)
    metrics = serve_metrics(engine.metrics.registry, config.host, config.metrics_port, "router")
    server, health_handle, port = await start_server(
        config.host,
        config.port,
        [lambda server: router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, server)],
        [SERVICE_NAME],
        security=security,
    )
    log.info("router listening on %s:%d, workers %s", config.host, port, ",".join(config.workers))
    # The engine keeps stepping through the grace period, so in-flight streams can finish.
    engine_stop = asyncio.Event()
    engine_task = asyncio.create_task(engine.run(engine_stop))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([engine_task, stopping], return_when=asyncio.FIRST_COMPLETED)
    if engine_task.done():
        stopping.cancel()
        error = engine_task.exception() if not engine_task.cancelled() else None
        log.critical("the engine loop ended unexpectedly; stopping the router", exc_info=error)
        await health_handle.set(False)
        await server.stop(0)
        raise EngineCrashed("the engine loop ended unexpectedly") from error
    await server.stop(SHUTDOWN_GRACE_S)
    engine_stop.set()
    await engine_task
    if metrics is not None:
        metrics.stop()


async def _main(config: RouterConfig) -> None:
    stop = asyncio.Event()
    install_stop_handlers(stop)
    await serve(config, stop)


def main(argv: Sequence[str] | None = None) -> None:
    config = config_from_args(argv)
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(_main(config))
    except EngineCrashed:
        sys.exit(1)  # already logged; a restart policy brings the router back
    except SecurityError as exc:
        raise SystemExit(f"router_service: {exc}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
