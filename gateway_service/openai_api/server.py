"""uvicorn serving the HTTP API on the gateway's own event loop, beside the gRPC server.

One loop for both APIs keeps one router pool, one tokenizer and one set of metrics; the work
per request on the loop is the same for both (detokenizing, stop strings). The socket is bound
here, before uvicorn starts, so that a taken port fails the gateway's start at once and a
port of 0 in tests gets a free one. Several gateway processes may listen on one port
(SO_REUSEPORT): the kernel spreads new connections over them. Signals stay with the gateway
(it stops this server).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from dataclasses import dataclass

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

# How often start() looks whether uvicorn is up (it binds no socket itself: that is done here).
STARTUP_POLL_S = 0.01


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """`head_timeout_s`: time a connection gets to send a complete request head, from when it
    opens or its previous response ended; `keep_alive_s`: how long an idle connection stays;
    `max_connections`: past it, requests are answered 503; `max_unread_body_bytes`: what is
    read and dropped of a body that was answered without being read (a 401, a 503) before the
    connection is closed."""

    head_timeout_s: float
    keep_alive_s: float
    max_connections: int
    max_unread_body_bytes: int


class _HeadTimedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head, which uvicorn lacks: its
    keep-alive timer stops at the first byte, so a connection that dribbles a head (or sends
    nothing at all after connecting) would stay open for good.

    And a bound on a body answered unread: uvicorn reads and drops the rest of it to keep the
    connection (so that a client which sends its whole body before reading sees the answer);
    past `max_unread_bytes` dropped, the connection is closed instead, so an unauthenticated
    upload costs the gateway at most that much reading."""

    def __init__(self, *args, head_timeout_s: float, max_unread_bytes: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._waiting_after = None  # the cycle before the awaited head (None: the first)
        self._max_unread_bytes = max_unread_bytes
        self._unread_left: int | None = None  # while a body answered unread is still arriving

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if self._unread_left is not None:
            self._unread_left -= len(data)
            if self._unread_left < 0:
                log.debug("closing an HTTP connection still sending a body answered unread after %d bytes",
                          self._max_unread_bytes)
                self.transport.close()
                return
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not self._waiting_after and self._head_timer is not None:
            self._head_timer.cancel()  # a head arrived: its request has started
            self._head_timer = None
        if self._unread_left is not None and self.conn.their_state is not h11.SEND_BODY:
            self._unread_left = None  # that body ended: what follows is the next request

    def on_response_complete(self) -> None:
        self._await_head()  # before uvicorn looks at pipelined requests, which may start one
        if self.conn.their_state is h11.SEND_BODY:
            self._unread_left = self._max_unread_bytes
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._waiting_after = self.cycle
        self._head_timer = self.loop.call_later(self._head_timeout_s, self._head_missing)

    def _head_missing(self) -> None:
        self._head_timer = None
        if self.cycle is self._waiting_after and not self.transport.is_closing():
            log.debug("closing an HTTP connection that sent no complete request head in %gs",
                      self._head_timeout_s)
            self.transport.close()


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
        cls, app: FastAPI, host: str, port: int, log_level: str, limits: ConnectionLimits,
        tls_cert: str = "", tls_key: str = "",
    ) -> "HttpServer":
        """Listen on host:port with `limits` on connections. With `tls_cert` / `tls_key` (the
        gateway's own, as on its gRPC port) it speaks HTTPS."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Gateway processes of one host share the port (`radixserve up --gateways N`), as gRPC
        # shares its own by default; a socket bound without it still makes this bind fail.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        sock.set_inheritable(True)
        config = uvicorn.Config(
            app, lifespan="off", log_level=log_level.lower(), access_log=False,
            http=functools.partial(_HeadTimedH11, head_timeout_s=limits.head_timeout_s,
                                   max_unread_bytes=limits.max_unread_body_bytes),
            timeout_keep_alive=limits.keep_alive_s, limit_concurrency=limits.max_connections,
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

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; open responses get `grace_s` to finish, then uvicorn cancels them
        (the gateway's drain has ended its streams before: this is what remains of its grace)."""
        self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        await self._task
