"""The router's state metrics are GetStats' answer: they read the source's `stats()` and nothing
else (the one conversion of the counters, `convert.stats_to_proto`)."""

from __future__ import annotations

from prometheus_client import generate_latest

from radixserve.v1 import router_pb2
from router_service.config import RouterConfig
from router_service.engine import Engine
from router_service.metrics import RouterMetrics


class FixedSource:
    model_name = "m"

    def __init__(self, stats: router_pb2.GetStatsResponse) -> None:
        self._stats = stats
        self.num_reads = 0

    def stats(self) -> router_pb2.GetStatsResponse:
        self.num_reads += 1
        return self._stats


def test_state_metrics_are_the_stats_answer() -> None:
    stats = router_pb2.GetStatsResponse(
        num_running=3, num_waiting=5, num_pages_total=100, num_pages_used=40, num_pages_evictable=10,
        num_pages_free=60, prompt_tokens=700, cache_hit_tokens=300, num_retractions=2, num_steps=11,
        num_draft_tokens=8, num_accepted_draft_tokens=6,
    )
    source = FixedSource(stats)
    exposed = generate_latest(RouterMetrics(source).registry).decode()
    assert source.num_reads == 1  # one scrape, one read
    for line in (
        'radixserve:num_requests_running{model_name="m"} 3.0',
        'radixserve:num_requests_waiting{model_name="m"} 5.0',
        'radixserve:kv_pages_free{model_name="m"} 60.0',
        'radixserve:kv_cache_usage_perc{model_name="m"} 0.3',
        'radixserve:prefix_cache_hits_total{model_name="m"} 300.0',
        'radixserve:num_retractions_total{model_name="m"} 2.0',
        'radixserve:spec_acceptance_rate{model_name="m"} 0.75',
    ):
        assert line in exposed


def test_an_engine_without_workers_reports_counters_only() -> None:
    engine = Engine(RouterConfig())
    stats = engine.stats()
    assert stats == router_pb2.GetStatsResponse()
    assert engine.model_name == ""
    assert 'radixserve:num_requests_running{model_name=""} 0.0' in generate_latest(engine.metrics.registry).decode()
