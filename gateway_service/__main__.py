"""`python -m gateway_service`: serve GenerationService on --host:--port until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from gateway_service.config import GatewayConfig, config_from_args
from gateway_service.server import Gateway
from radixserve.serving import install_stop_handlers

log = logging.getLogger("gateway_service")


async def serve(config: GatewayConfig) -> None:
    stop = asyncio.Event()
    install_stop_handlers(stop)
    gateway = await Gateway.start(config)
    await stop.wait()
    log.info("stopping")
    await gateway.stop()


def main(argv: Sequence[str] | None = None) -> None:
    config = config_from_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
