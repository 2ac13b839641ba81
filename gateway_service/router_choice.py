"""Choosing a router replica: prefix-affine rendezvous hashing, failover order, probing; and
the calls that carry requests to it (router_stream.py).

Requests whose prompts share their first `affinity_tokens` token ids hash to the same router,
so each replica's prefix cache stays warm without any shared state between gateways. The
rendezvous (highest random weight) order also gives the failover order: when the first choice
is down, its requests spread over the others the same way on every gateway, and adding or
removing one replica only moves the prompts that hashed to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from gateway_service.router_stream import RouterStream
from radixserve.security import Security
from radixserve.serving import CHANNEL_OPTIONS, KEEPALIVE_TIME_MS, NO_SECURITY
from radixserve.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

# A router that answers no probe for this long has its in-flight requests failed: the
# keepalive window the README states for a frozen or partitioned router (~15-20 s, counting the
# probes' interval and timeout on top).
SILENT_ROUTER_S = KEEPALIVE_TIME_MS / 1000

# Reconnect quickly after a router restarts: gRPC's default backoff grows to two minutes.
ROUTER_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def affinity_key(prompt_token_ids: Sequence[int], affinity_tokens: int) -> bytes:
    head = prompt_token_ids[:affinity_tokens]
    return b",".join(str(t).encode() for t in head)


def rendezvous_order(addresses: Sequence[str], key: bytes) -> list[str]:
    """Addresses from most to least preferred for `key` (stable for a given set)."""

    def weight(address: str) -> tuple[int, str]:
        digest = hashlib.blake2b(address.encode() + b"\x00" + key, digest_size=8).digest()
        return int.from_bytes(digest, "big"), address

    return sorted(addresses, key=weight, reverse=True)


class RouterPool:
    """One channel per router, which routers answered lately, and what they serve.

    A router counts as up after it answers GetServerInfo and as down after a probe or a
    Generate call finds it UNAVAILABLE. Down routers stay in the failover order, last.
    Channels use TLS and every call carries the internal token as `security` says
    (`call_metadata` is what callers of `stub` pass on).
    """

    def __init__(
        self, addresses: Sequence[str], affinity_tokens: int, probe_timeout_s: float,
        security: Security = NO_SECURITY,
    ) -> None:
        if not addresses:
            raise ValueError("at least one router address is needed")
        self.addresses = tuple(addresses)
        self._affinity_tokens = affinity_tokens
        self._probe_timeout_s = probe_timeout_s
        self.call_metadata = security.call_metadata()
        self._channels = {
            a: security.aio_channel(a, ROUTER_CHANNEL_OPTIONS) for a in self.addresses
        }
        self._stubs = {a: router_pb2_grpc.RouterServiceStub(c) for a, c in self._channels.items()}
        self._up = dict.fromkeys(self.addresses, False)
        self._info: dict[str, router_pb2.GetServerInfoResponse] = {}
        self._streams: dict[str, RouterStream] = {}
        self._no_stream: set[str] = set()
        # When each router not answering its probes was first asked without an answer.
        self._silent_since: dict[str, float] = {}

    @property
    def info(self) -> router_pb2.GetServerInfoResponse | None:
        """The model as the first reachable router describes it (replicas serve one model)."""
        for address in self.addresses:
            if self._up[address] and address in self._info:
                return self._info[address]
        return next(iter(self._info.values()), None)

    def stub(self, address: str) -> router_pb2_grpc.RouterServiceStub:
        return self._stubs[address]

    async def generate(
        self, address: str, request: router_pb2.RouterGenerateRequest, deadline: float | None
    ) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        """One request's responses from the router at `address` (`deadline` on
        `time.monotonic()`): on the gateway's shared Stream call to it, or on a Generate call of
        its own where the router has no Stream (an older one). Raises `grpc.aio.AioRpcError`."""
        if address not in self._no_stream:
            stream = self._streams.get(address)
            if stream is None or stream.failed is not None:
                stream = self._streams[address] = RouterStream(self._stubs[address], self.call_metadata)
            try:
                async with contextlib.aclosing(stream.generate(request, deadline)) as responses:
                    async for response in responses:
                        yield response
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.info("router %s has no Stream: one Generate call per request", address)
                self._no_stream.add(address)
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        call = self._stubs[address].Generate(request, timeout=timeout, metadata=self.call_metadata)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()  # no-op once finished; frees the router's pages otherwise

    def _fail_streams_of_silent(self, address: str, probe_sent: float) -> None:
        """A router that answered no probe for `SILENT_ROUTER_S`: end the requests on its
        stream (UNAVAILABLE). A frozen router's kernel still acknowledges TCP, and gRPC's
        keepalive pings did not end such a stream in practice (issue 34: 68.7 s)."""
        silent_s = time.monotonic() - self._silent_since.setdefault(address, probe_sent)
        stream = self._streams.get(address)
        if silent_s >= SILENT_ROUTER_S and stream is not None and stream.failed is None:
            stream.abandon(f"the router has not answered for {silent_s:.0f}s")

    def order(self, prompt_token_ids: Sequence[int]) -> list[str]:
        """Failover order for a prompt: rendezvous order, routers known to be down last."""
        ranked = rendezvous_order(self.addresses, affinity_key(prompt_token_ids, self._affinity_tokens))
        return [a for a in ranked if self._up[a]] + [a for a in ranked if not self._up[a]]

    def mark_down(self, address: str) -> None:
        if self._up[address]:
            log.warning("router %s is unavailable", address)
        self._up[address] = False

    async def probe(self, address: str) -> bool:
        sent = time.monotonic()
        try:
            reply = await self._stubs[address].GetServerInfo(
                router_pb2.GetServerInfoRequest(), timeout=self._probe_timeout_s,
                metadata=self.call_metadata,
            )
        except grpc.aio.AioRpcError as exc:
            if self._up[address]:
                log.warning("router %s stopped answering: %s", address, exc.code().name)
            self._up[address] = False
            self._fail_streams_of_silent(address, sent)
            return False
        self._silent_since.pop(address, None)
        if not self._up[address]:
            log.info("router %s is up (%s)", address, reply.model.model_name)
        self._info[address] = reply
        self._up[address] = True
        return True

    async def probe_all(self) -> bool:
        """Ask every router for its info; True when at least one answered."""
        results = await asyncio.gather(*(self.probe(a) for a in self.addresses))
        return any(results)

    async def close(self) -> None:
        await asyncio.gather(*(stream.close() for stream in self._streams.values()))
        await asyncio.gather(*(c.close() for c in self._channels.values()))
