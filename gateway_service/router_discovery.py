"""Which routers exist: the static `--routers` list plus the addresses a DNS name resolves to
(`--router-dns`: a headless Service, one address per ready router pod), re-resolved every
`--router-dns-interval-s`.

Routers found by DNS are called by address; their certificates are checked for the DNS name
(`tls_name`), which every router's certificate carries (the headless Service's name).

A resolution that fails keeps the last addresses it found (a DNS hiccup must not drain every
replica); one that answers is the new set. What changed is the router pool's business
(`RouterPool.set_addresses`: new routers join, removed ones drain).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence

from radixserve.flags import split_address

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, as `ip:port` (`[ip]:port` for IPv6), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found = set()
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        found.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(found)


class RouterDiscovery:
    def __init__(
        self, static: Sequence[str], dns_name: str, interval_s: float, resolver: Resolver = resolve
    ) -> None:
        self._static = tuple(static)
        self._dns = split_address(dns_name, "router-dns") if dns_name else None
        self._interval_s = interval_s
        self._resolver = resolver
        self._found: list[str] = []
        self._resolved_at: float | None = None

    def tls_name(self, address: str) -> str | None:
        """The name to check a router's certificate for: the DNS name for the addresses it gave
        (None for the static ones, checked for their own host)."""
        if self._dns is None or address in self._static or address not in self._found:
            return None
        return self._dns[0]

    @property
    def dynamic(self) -> bool:
        return self._dns is not None

    async def addresses(self) -> tuple[str, ...]:
        """The routers now: the static ones and those the DNS name gave at its last resolution
        (resolved again when the interval has passed since)."""
        now = time.monotonic()
        if self._dns is not None and (self._resolved_at is None or now - self._resolved_at >= self._interval_s):
            self._resolved_at = now
            host, port = self._dns
            try:
                found = await self._resolver(host, port)
            except OSError as exc:  # socket.gaierror included
                log.warning("resolving %s:%d failed (%s): keeping its %d router(s)", host, port, exc,
                            len(self._found))
            else:
                if found != self._found:
                    log.info("%s:%d resolves to %d router(s): %s", host, port, len(found), ", ".join(found))
                self._found = found
        return tuple(dict.fromkeys([*self._static, *self._found]))
