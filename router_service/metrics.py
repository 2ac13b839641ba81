"""The router's Prometheus metrics.

State (running and waiting requests, KV pages, prefix-cache and retraction counters) is read
from the engine when Prometheus scrapes, as GetStats' own answer (`Engine.stats`, the one
conversion `convert.stats_to_proto`), so the two never disagree. The metrics know the engine
only as a `StateSource`: the engine imports this module, never the other way round. Per-step
and per-request timings (step duration, batch size, queue time) and worker reconnects are
observed by the engine as they happen.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.metrics import MODEL_LABEL, count_histogram, counter, gap_histogram, latency_histogram, name
from radixserve.v1 import router_pb2
from router_service.core.step_plan import StepPlan


class StateSource(Protocol):
    """What the metrics read at scrape time (the engine)."""

    @property
    def model_name(self) -> str:
        """The model served ("" while the workers are not connected)."""
        ...

    def stats(self) -> router_pb2.GetStatsResponse:
        """GetStats' answer."""
        ...


class RouterMetrics:
    """One per engine. Its methods are the engine's hooks; they never raise."""

    def __init__(self, source: StateSource, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._source = source
        self._arrivals: dict[str, float] = {}
        self._num_connects = 0
        r = self.registry
        self.step_duration = latency_histogram(
            r, "step_duration_seconds", "One scheduler step: plan, execute on the workers, apply (with overlap, also the step it ran behind).", [])
        self.batch_requests = count_histogram(
            r, "step_batch_requests", "Requests (prefill chunks and decodes) in one step.", [])
        self.batch_tokens = count_histogram(r, "step_batch_tokens", "Tokens computed in one step.", [])
        self.queue_time = latency_histogram(
            r, "request_queue_time_seconds", "From a request's arrival to its first scheduled step.", [])
        self.worker_idle = gap_histogram(
            r, "worker_idle_between_steps_seconds",
            "Time the worker ranks (the slowest) idled between two steps sent back to back.", [])
        self.router_cpu = gap_histogram(
            r, "router_step_cpu_seconds",
            "The router's CPU time per step on its event loop: planning it and applying its result.", [])
        self.reconnects = counter(r, "worker_reconnects", "Connections to the worker group after the first one.", [])
        self.registry.register(_StateCollector(source))

    def _model(self) -> str:
        return self._source.model_name

    def submitted(self, request_id: str) -> None:
        self._arrivals[request_id] = time.monotonic()

    def ended(self, request_id: str) -> None:
        self._arrivals.pop(request_id, None)

    def step(self, plan: StepPlan, started: float) -> None:
        """After a step that ran `plan` (began at `started`, on `time.monotonic()`)."""
        model = self._model()
        now = time.monotonic()
        self.step_duration.labels(model).observe(now - started)
        self.batch_requests.labels(model).observe(len(plan.entries))
        self.batch_tokens.labels(model).observe(plan.num_tokens)
        arrivals = self._arrivals
        for entry in plan.entries:
            if not entry.new_request:
                continue  # a request's first step is always one with `new_request`
            arrival = arrivals.pop(entry.request.request_id, None)
            if arrival is not None:  # the request's first step (a retracted one counts once)
                self.queue_time.labels(model).observe(started - arrival)

    def step_costs(self, router_cpu_s: float, worker_idle_s: float | None) -> None:
        """After a step's result was applied (see `step_costs`); idle None: not back to back."""
        model = self._model()
        self.router_cpu.labels(model).observe(router_cpu_s)
        if worker_idle_s is not None:
            self.worker_idle.labels(model).observe(worker_idle_s)

    def connected(self) -> None:
        self._num_connects += 1
        if self._num_connects > 1:
            self.reconnects.labels(self._model()).inc()


class _StateCollector(Collector):
    """Gauges and counters read from the engine at scrape time (GetStats' numbers)."""

    def __init__(self, source: StateSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        model = self._source.model_name
        stats = self._source.stats()

        total, used, cached = stats.num_pages_total, stats.num_pages_used, stats.num_pages_evictable
        gauges = [
            ("num_requests_running", "Requests in the running batch.", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("kv_pages_total", "KV pages in the pool.", total),
            ("kv_pages_used", "KV pages held (by requests or the prefix cache).", used),
            ("kv_pages_cached", "KV pages held only by the prefix cache (evictable).", cached),
            ("kv_pages_free", "KV pages free.", stats.num_pages_free),
            ("kv_cache_usage_perc", "Fraction of KV pages held by running requests (0 to 1).",
             (used - cached) / total if total else 0.0),
            ("spec_acceptance_rate", "Accepted / verified draft tokens since start (0 when none).",
             stats.num_accepted_draft_tokens / stats.num_draft_tokens if stats.num_draft_tokens else 0.0),
        ]
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prompt_tokens),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", stats.cache_hit_tokens),
            ("num_retractions", "Running requests taken back to the queue for pages.", stats.num_retractions),
            ("scheduler_steps", "Scheduler steps run on the workers.", stats.num_steps),
            ("spec_draft_tokens", "Draft tokens proposed and verified (speculative decoding).",
             stats.num_draft_tokens),
            ("spec_accepted_tokens", "Draft tokens accepted (speculative decoding).", stats.num_accepted_draft_tokens),
        ]
        for kind, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for base, doc, value in rows:
                metric = kind(name(base), doc, labels=[MODEL_LABEL])
                metric.add_metric([model], value)
                yield metric
