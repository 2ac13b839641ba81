"""Choosing a router replica: bounded-load prefix affinity over the routers' load reports,
failover order, probing, the set of routers changing at run time; and the calls that carry
requests to it (router_stream.py).

A request goes to a replica the prefix memory names for its longest known prefix while that
replica's load stays within a bound of the mean (`Bounds.session` for a conversation's history,
`Bounds.memory` for a shared prefix), else to the first in its rendezvous order (`rendezvous`)
while its load stays within `Bounds.load` times the mean; otherwise to the next in rendezvous
order that is (`bounded_load.choose_remembered`, which the simulator replays); with
`--recompute-tokens`, to the one of those replicas costing the least work, load above the bound
against prompt tokens to recompute (`bounded_load.choose_by_work`).
The rest of the rendezvous order is the failover order, as before. A router's load is what it
last reported on the gateway's Stream call to it (running plus waiting requests, every step and
every load report interval), plus the requests this gateway opened there since that report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import grpc

from gateway_service.bounded_load import Bounds, choose_remembered
from gateway_service.errors import NoRouterAvailable
from gateway_service.prefix_memory import PrefixMemory
from gateway_service.rendezvous import Ranking, affinity_key, ranked
from gateway_service.router_stream import Lane, RouterStream, rpc_error
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


class RouterPool:
    """One channel per router, which routers answered lately, what they serve, and their load.

    A router counts as up after it answers GetServerInfo and as down after a probe or a
    Generate call finds it UNAVAILABLE. Down routers stay in the failover order, last.
    `set_addresses` changes the set at run time: new routers come in down (the next probe
    brings them up); removed ones take no new request and are closed once the requests this
    gateway has on them have ended (`close_drained`).
    Channels use TLS and every call carries the internal token as `security` says
    (`call_metadata` is what callers of `stub` pass on).
    """

    def __init__(
        self, addresses: Sequence[str], affinity_tokens: int, probe_timeout_s: float,
        security: Security = NO_SECURITY, *, bounds: Bounds,
        memory: PrefixMemory[str] | None = None, tls_name: Callable[[str], str | None] = lambda address: None,
    ) -> None:
        """`tls_name`: the name a router's certificate is checked for where it is not the host of
        its address (routers found by DNS, see `router_discovery`)."""
        self._affinity_tokens = affinity_tokens
        self._probe_timeout_s = probe_timeout_s
        self._bounds = bounds
        self._memory = memory
        self._security = security
        self._tls_name = tls_name
        self.call_metadata = security.call_metadata()
        self.addresses: tuple[str, ...] = ()
        self._ranking = Ranking(())
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, router_pb2_grpc.RouterServiceStub] = {}
        self._up: dict[str, bool] = {}
        self._info: dict[str, router_pb2.GetServerInfoResponse] = {}
        self._streams: dict[str, RouterStream] = {}
        self._no_stream: set[str] = set()
        # When each router not answering its probes was first asked without an answer.
        self._silent_since: dict[str, float] = {}
        self.loads: dict[str, router_pb2.RouterLoad] = {}  # each router's last report
        self._opened: dict[str, int] = {}  # requests opened here since that report
        self._in_flight: dict[str, int] = {}  # this gateway's requests on each router now
        self._draining: set[str] = set()
        self.set_addresses(addresses)

    def set_addresses(self, addresses: Sequence[str]) -> None:
        """Route over these routers from now on (see the class's docstring)."""
        wanted = tuple(sorted(set(addresses)))
        if wanted == self.addresses:
            return
        for address in wanted:
            self._draining.discard(address)
            if address not in self._channels:
                name = self._tls_name(address)
                options = ROUTER_CHANNEL_OPTIONS + ([("grpc.ssl_target_name_override", name)] if name else [])
                channel = self._channels[address] = self._security.aio_channel(address, options)
                self._stubs[address] = router_pb2_grpc.RouterServiceStub(channel)
                self._up[address] = False
                self._opened[address] = self._in_flight[address] = 0
        for address in set(self.addresses) - set(wanted):
            log.info("router %s left the set: draining it", address)
            self._draining.add(address)
            if self._memory is not None:
                self._memory.forget(address)
        self.addresses = wanted
        self._ranking = Ranking(wanted)

    async def close_drained(self) -> None:
        """Close the removed routers that no request of this gateway uses any more."""
        for address in [a for a in self._draining if not self._in_flight[a]]:
            self._draining.discard(address)
            stream = self._streams.pop(address, None)
            if stream is not None:
                await stream.close()
            await self._channels.pop(address).close()
            for table in (self._stubs, self._up, self._info, self._silent_since, self.loads, self._opened,
                          self._in_flight):
                table.pop(address, None)
            self._no_stream.discard(address)
            log.info("router %s drained and closed", address)

    @property
    def info(self) -> router_pb2.GetServerInfoResponse | None:
        """The model as the first reachable router describes it (replicas serve one model)."""
        for address in self.addresses:
            if self._up[address] and address in self._info:
                return self._info[address]
        return next(iter(self._info.values()), None)

    def stub(self, address: str) -> router_pb2_grpc.RouterServiceStub:
        return self._stubs[address]

    def load(self, address: str) -> int:
        """Outstanding requests on the router as this gateway knows them: its last report plus
        what was opened here since; this gateway's own requests where it never reported."""
        report = self.loads.get(address)
        if report is None:
            return self._in_flight[address]
        return report.num_running + report.num_waiting + self._opened[address]

    async def generate(
        self, address: str, request: router_pb2.RouterGenerateRequest, deadline: float | None,
        lane: Lane | None = None,
    ) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        """One request's responses from the router at `address` (`deadline` on
        `time.monotonic()`): on the gateway's shared Stream call to it, or on a Generate call of
        its own where the router has no Stream (an older one). Raises `grpc.aio.AioRpcError`
        (UNAVAILABLE for a router drained and closed since the request's order was made).
        `lane`: where the request's plain tokens may go instead (router_stream.py; a Generate
        call has none)."""
        if address not in self._stubs:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "the router left the set")
        self._in_flight[address] += 1
        self._opened[address] += 1
        try:
            async with contextlib.aclosing(self._generate(address, request, deadline, lane)) as responses:
                async for response in responses:
                    yield response
        finally:
            self._in_flight[address] -= 1

    async def _generate(
        self, address: str, request: router_pb2.RouterGenerateRequest, deadline: float | None, lane: Lane | None,
    ) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        if address not in self._no_stream:
            stream = self._stream(address)
            yielded = False
            try:
                async with contextlib.aclosing(stream.generate(request, deadline, lane)) as responses:
                    async for response in responses:
                        yielded = True
                        yield response
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("router %s has no Stream: one Generate call per request", address)
                    self._no_stream.add(address)
                # A router without Stream refuses the call at once; a write racing that refusal
                # can end the call with grpc's own INTERNAL ("Internal error from Core") instead
                # of UNIMPLEMENTED. A call the router never answered, for a request that got
                # nothing yet, is that race: this request goes by Generate (the next call finds
                # out which it was).
                elif exc.code() != grpc.StatusCode.INTERNAL or yielded or stream.answered:
                    raise
                else:
                    log.info("router %s ended a Stream call unanswered (%s): this request by Generate",
                             address, exc.details())
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        call = self._stubs[address].Generate(request, timeout=timeout, metadata=self.call_metadata)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()  # no-op once finished; frees the router's pages otherwise

    def _stream(self, address: str) -> RouterStream:
        """The open Stream call to the router (a new one when there is none or it ended)."""
        stream = self._streams.get(address)
        if stream is None or stream.failed is not None:
            if stream is not None and stream.failed.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._no_stream.add(address)
            stream = self._streams[address] = RouterStream(
                self._stubs[address], self.call_metadata, lambda load: self._on_load(address, load))
        return stream

    def _on_load(self, address: str, load: router_pb2.RouterLoad) -> None:
        if address in self._opened:  # else: drained meanwhile
            self.loads[address] = load
            self._opened[address] = 0

    def _fail_streams_of_silent(self, address: str, probe_sent: float) -> None:
        """A router that answered no probe for `SILENT_ROUTER_S`: end the requests on its
        stream (UNAVAILABLE). A frozen router's kernel still acknowledges TCP, and gRPC's
        keepalive pings did not end such a stream in practice (issue 34: 68.7 s)."""
        silent_s = time.monotonic() - self._silent_since.setdefault(address, probe_sent)
        stream = self._streams.get(address)
        if silent_s >= SILENT_ROUTER_S and stream is not None and stream.failed is None:
            stream.abandon(f"the router has not answered for {silent_s:.0f}s")

    def order(self, prompt_token_ids: Sequence[int]) -> Iterator[str]:
        """Routers to try for a prompt, in order: the bounded-load choice among the routers up,
        then the rest of the rendezvous order, routers known to be down last (computed only
        when the caller asks for more than the first)."""
        addresses = self.addresses
        weights = self._ranking.weights(affinity_key(prompt_token_ids, self._affinity_tokens))
        up = [i for i, address in enumerate(addresses) if self._up[address]]
        chosen = None
        if up:
            replicas = [addresses[i] for i in up]
            loads = {address: self.load(address) for address in replicas}
            chosen = choose_remembered(replicas, weights[up], loads, self._bounds, self._memory, prompt_token_ids)
            yield chosen
        rest = [addresses[i] for i in ranked(weights) if addresses[i] != chosen]
        yield from [a for a in rest if self._up.get(a, False)] + [a for a in rest if not self._up.get(a, False)]

    async def generate_failing_over(
        self, request: router_pb2.RouterGenerateRequest, deadline: float | None, lane: Lane | None = None,
    ) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        """The router's responses, failing over to the next router in rendezvous order when
        one is UNAVAILABLE before it streamed anything (`lane`: as `generate`'s)."""
        failures: list[str] = []
        for address in self.order(request.prompt_token_ids):
            streamed = False
            try:
                async with contextlib.aclosing(self.generate(address, request, deadline, lane)) as responses:
                    async for response in responses:
                        streamed = streamed or bool(response.token_ids) or response.finish_reason != 0
                        yield response
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or streamed:
                    raise
                self.mark_down(address)
                failures.append(f"{address}: {exc.details() or exc.code().name}")
        # Router addresses and their errors are for the operator, not for the caller.
        log.warning("request %s: no router could take it (%s)", request.request_id, "; ".join(failures))
        raise NoRouterAvailable("no router could take the request")

    def mark_down(self, address: str) -> None:
        if self._up.get(address):
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
            if self._up.get(address):
                log.warning("router %s stopped answering: %s", address, exc.code().name)
            if address in self._up:
                self._up[address] = False
                self._fail_streams_of_silent(address, sent)
            return False
        if address not in self._up:
            return False  # drained while the probe was out
        self._silent_since.pop(address, None)
        if not self._up[address]:
            log.info("router %s is up (%s)", address, reply.model.model_name)
        self._info[address] = reply
        self._up[address] = True
        if address in self.loads and address not in self._no_stream:
            # Reopen a Stream that ended on a router known to have one (it reported a load), so
            # that its load reports flow before the next request; the first Stream call to a
            # router is opened by a request, which falls back to Generate where it has none.
            self._stream(address)
        return True

    async def probe_all(self) -> bool:
        """Ask every router for its info and close drained ones; True when one answered."""
        results = await asyncio.gather(*(self.probe(a) for a in self.addresses))
        await self.close_drained()
        return any(results)

    async def close(self) -> None:
        await asyncio.gather(*(stream.close() for stream in self._streams.values()))
        await asyncio.gather(*(c.close() for c in self._channels.values()))
