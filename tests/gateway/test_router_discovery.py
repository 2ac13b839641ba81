"""Router discovery: the static routers plus what a DNS name resolves to, re-resolved on an
interval; a failed resolution keeps the last answer (DNS stubbed: `socket.getaddrinfo`)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gateway_service.router_discovery import RouterDiscovery, resolve
from radixserve.flags import split_address


def test_re_resolved_on_its_interval_and_a_failure_keeps_the_last_answer(monkeypatch) -> None:
    answers = [["10.0.0.1", "10.0.0.2"], OSError("no answer"), ["10.0.0.3", "10.0.0.2"], []]
    calls = []
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host != "routers.test":
            return real(host, port, *args, **kwargs)
        calls.append(host)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answer] + \
               [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::1", port, 0, 0))] * bool(answer)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    async def scenario() -> None:
        discovery = RouterDiscovery(("static:50052",), "routers.test:50052", interval_s=0.05)
        assert discovery.dynamic
        first = await discovery.addresses()
        assert first == ("static:50052", "10.0.0.1:50052", "10.0.0.2:50052", "[fd00::1]:50052")
        assert await discovery.addresses() == first and len(calls) == 1  # within the interval
        assert discovery.tls_name("10.0.0.1:50052") == "routers.test"
        assert discovery.tls_name("static:50052") is None
        await asyncio.sleep(0.06)
        assert await discovery.addresses() == first  # the resolution failed: kept
        await asyncio.sleep(0.06)
        assert await discovery.addresses() == ("static:50052", "10.0.0.2:50052", "10.0.0.3:50052",
                                                "[fd00::1]:50052")
        assert discovery.tls_name("10.0.0.1:50052") is None  # gone
        await asyncio.sleep(0.06)
        # No address at all (a name with no records resolves to an error, kept as a failure; an
        # empty answer is the new set).
        assert await discovery.addresses() == ("static:50052",)
        assert len(calls) == 4

    asyncio.run(scenario())


def test_static_only_and_bad_names() -> None:
    discovery = RouterDiscovery(("a:1", "b:2", "a:1"), "", 1.0)
    assert not discovery.dynamic
    assert asyncio.run(discovery.addresses()) == ("a:1", "b:2")
    assert split_address("[fd00::1]:50052", "router-dns") == ("fd00::1", 50052)
    for bad in ("routers", "routers:", ":50052", "[]:50052", "routers:http", "routers:70000", "routers:0",
                "http://routers:50052"):
        with pytest.raises(ValueError, match="--router-dns must be host:port"):
            split_address(bad, "router-dns")
        with pytest.raises(ValueError, match="--router-dns must be host:port"):
            RouterDiscovery((), bad, 1.0)
    assert asyncio.run(resolve("127.0.0.1", 50052)) == ["127.0.0.1:50052"]
