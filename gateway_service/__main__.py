"""`python -m gateway_service`: serve GenerationService on --host:--port until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from gateway_service.config import GatewayConfig, config_from_args
from gateway_service.server import Gateway
from radixserve.security import SecurityError
from radixserve.serving import install_stop_handlers

log = logging.getLogger("gateway_service")


async def serve(config: GatewayConfig) -> int:
    """Serve until SIGINT / SIGTERM (then drain, exit 0) or a background task dies (exit 1)."""
    stop = asyncio.Event()
    install_stop_handlers(stop)
    gateway = await Gateway.start(config)
    stopping = asyncio.ensure_future(stop.wait())
    crashed = asyncio.ensure_future(gateway.crashed.wait())
    await asyncio.wait([stopping, crashed], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    crashed.cancel()
    log.info("stopping: draining in-flight streams for up to %gs", config.shutdown_grace_s)
    await gateway.stop()
    log.info("stopped")
    return 1 if gateway.crashed.is_set() else 0


def main(argv: Sequence[str] | None = None) -> None:
    config = config_from_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        sys.exit(asyncio.run(serve(config)))
    except SecurityError as exc:
        raise SystemExit(f"gateway_service: {exc}") from None


if __name__ == "__main__":
    main()
