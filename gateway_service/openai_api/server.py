"""uvicorn serving the HTTP API on the gateway's own event loop, beside the gRPC server.

One loop for both APIs keeps one router pool, one tokenizer and one set of metrics; the work
per request on the loop is the same for both (detokenizing, stop strings). The socket is bound
here, before uvicorn starts, so that a taken port fails the gateway's start at once and a
port of 0 in tests gets a free one. Signals stay with the gateway (it stops this server).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn
from fastapi import FastAPI

log = logging.getLogger(__name__)

# Seconds uvicorn waits for the first request line on a new connection.
KEEP_ALIVE_S = 5
# How often start() looks whether uvicorn is up (it binds no socket itself: that is done here).
STARTUP_POLL_S = 0.01


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # The gateway installs its own SIGINT/SIGTERM handlers and stops this server itself.
        yield


class HttpServer:
    """A running uvicorn server; `port` is the bound port."""

    def __init__(self, server: _Server, task: asyncio.Task, port: int) -> None:
        self._server = server
        self._task = task
        self.port = port

    @classmethod
    async def start(
        cls, app: FastAPI, host: str, port: int, log_level: str, shutdown_grace_s: float,
        tls_cert: str = "", tls_key: str = "",
    ) -> "HttpServer":
        """Listen on host:port; on `stop`, open responses get `shutdown_grace_s` to finish,
        then uvicorn cancels them (which cancels their router calls). With `tls_cert` /
        `tls_key` (the gateway's own, as on its gRPC port) it speaks HTTPS."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        sock.set_inheritable(True)
        config = uvicorn.Config(
            app, lifespan="off", log_level=log_level.lower(), access_log=False,
            timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=shutdown_grace_s,
            ssl_certfile=tls_cert or None, ssl_keyfile=tls_key or None,
        )
        server = _Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():  # failed while starting: raise its error
                await task
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(STARTUP_POLL_S)
        bound = sock.getsockname()[1]
        scheme = "https" if tls_cert else "http"
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", scheme, host, bound)
        return cls(server, task, bound)

    async def stop(self) -> None:
        """Stop accepting; returns once open responses finished or the grace period ended."""
        self._server.should_exit = True
        await self._task
