"""A Prometheus histogram for a series observed on one thread, at the cost of a list increment.

The gateway observes its inter-token latency once per streamed token, on its event loop.
prometheus-client's `Histogram.observe` takes a lock twice (the sum, then the bucket) and scans
the buckets in order: ~0.9 us a token in `bench.gateway_token_cost`, about 6% of the gateway's
Python per token. `LoopHistogram` keeps plain counts: `observe` finds the bucket by bisection
and adds one, with no lock, so it must be called from one thread only. A scrape (prometheus-
client's server thread) copies the counts in one step under the GIL, so the buckets, `_count`
and `_sum` it exposes agree with each other up to at most the one observation being made. It
exposes the same series, names and values as a `prometheus_client.Histogram` with the same
arguments (tests/radixserve/test_loop_histogram.py compares the two).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import INF, floatToGoString


class _Child:
    """One label set's counts; `counts[i]` observations fell in bucket i (not cumulative)."""

    __slots__ = ("counts", "sum", "_bounds")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self._bounds = bounds

    def observe(self, amount: float) -> None:
        # The first bound at or above the amount: a bucket counts what is <= its bound. A NaN
        # is in no bucket but in the sum, as prometheus-client has it.
        if amount == amount:
            self.counts[bisect.bisect_left(self._bounds, amount)] += 1
        self.sum += amount


class LoopHistogram:
    """`labels(*values).observe(amount)`, as `prometheus_client.Histogram` (no exemplars), from
    one thread; registered in `registry`."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        bounds = sorted(float(bound) for bound in buckets)
        if bounds[-1] != INF:
            bounds.append(INF)
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._bounds = tuple(bounds)
        self._le = tuple(floatToGoString(bound) for bound in bounds)
        self._children: dict[tuple[str, ...], _Child] = {}
        registry.register(self)

    def labels(self, *values: object) -> _Child:
        key = tuple(str(value) for value in values)
        child = self._children.get(key)
        if child is None:
            if len(key) != len(self._labelnames):
                raise ValueError(f"{self._name}: {len(self._labelnames)} label values expected, got {len(key)}")
            child = self._children[key] = _Child(self._bounds)
        return child

    def describe(self) -> Iterator[Metric]:
        yield Metric(self._name, self._documentation, "histogram")

    def collect(self) -> Iterator[Metric]:
        metric = Metric(self._name, self._documentation, "histogram")
        for values, child in list(self._children.items()):
            labels = dict(zip(self._labelnames, values))
            counts, total = list(child.counts), child.sum
            cumulative = 0.0
            for le, count in zip(self._le, counts):
                cumulative += count
                metric.add_sample(self._name + "_bucket", {**labels, "le": le}, cumulative)
            metric.add_sample(self._name + "_count", labels, cumulative)
            metric.add_sample(self._name + "_sum", labels, total)
        yield metric
