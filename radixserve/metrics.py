"""Prometheus plumbing shared by the services: the `/metrics` HTTP endpoint and naming.

Every service keeps its metrics in its own `CollectorRegistry` (so tests can run several
services in one process) and serves it on `--metrics-port` (0 turns it off) from
prometheus-client's own HTTP server thread: a scrape never waits on the service's event loop.
Names follow vLLM's conventions: a `radixserve:` prefix, base units in the name (`_seconds`,
`_tokens`), counters ending in `_total`, and a `model_name` label on every series.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, start_http_server

log = logging.getLogger(__name__)

# `*_created` timestamps double the series count and no dashboard reads them (vLLM drops them too).
disable_created_metrics()

PREFIX = "radixserve:"
MODEL_LABEL = "model_name"
# Latency buckets (seconds) from a fast decode step to a long generation.
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
# Gaps between steps (worker idle time): overlap scheduling aims below a millisecond.
GAP_BUCKETS_S = (
    0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
)
# Count buckets (requests or tokens in a step), powers of two up to a large prefill batch.
COUNT_BUCKETS = tuple(float(1 << i) for i in range(14))


def name(base: str) -> str:
    """`time_to_first_token_seconds` -> `radixserve:time_to_first_token_seconds`."""
    return PREFIX + base


def latency_histogram(registry: CollectorRegistry, base: str, doc: str, labels: Sequence[str]) -> Histogram:
    """A histogram of seconds, `model_name` first among its labels."""
    return Histogram(name(base), doc, [MODEL_LABEL, *labels], buckets=LATENCY_BUCKETS_S, registry=registry)


def gap_histogram(registry: CollectorRegistry, base: str, doc: str, labels: Sequence[str]) -> Histogram:
    """A histogram of short gaps in seconds (sub-millisecond buckets), `model_name` first."""
    return Histogram(name(base), doc, [MODEL_LABEL, *labels], buckets=GAP_BUCKETS_S, registry=registry)


def count_histogram(registry: CollectorRegistry, base: str, doc: str, labels: Sequence[str]) -> Histogram:
    """A histogram of counts (requests, tokens), `model_name` first among its labels."""
    return Histogram(name(base), doc, [MODEL_LABEL, *labels], buckets=COUNT_BUCKETS, registry=registry)


def counter(registry: CollectorRegistry, base: str, doc: str, labels: Sequence[str]) -> Counter:
    """A counter (exposed as `base_total`), `model_name` first among its labels."""
    return Counter(name(base), doc, [MODEL_LABEL, *labels], registry=registry)


@dataclass
class MetricsServer:
    """A running `/metrics` endpoint; `port` is the bound port (useful when asked for 0)."""

    port: int
    _server: WSGIServer
    _thread: threading.Thread

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class CannotListen(OSError):
    """A service's port (gRPC, or /metrics) cannot be listened on: the service stops with this
    one line (`serving.run_service`), not a traceback."""


def serve_metrics(registry: CollectorRegistry, host: str, port: int, what: str) -> MetricsServer | None:
    """Serve `registry` at http://host:port/metrics; None when `port` is 0 (metrics off)."""
    if port == 0:
        return None
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise CannotListen(f"cannot serve /metrics on {host}:{port}: {exc.strerror or exc}") from None
    bound = server.server_address[1]
    log.info("%s metrics on http://%s:%d/metrics", what, host, bound)
    return MetricsServer(bound, server, thread)
