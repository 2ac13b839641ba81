"""The Grafana dashboard under deploy/grafana: well-formed dashboard JSON whose every query
names only metrics that the gateway, router and worker really export (their own registries)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from gateway_service.metrics import GatewayMetrics
from router_service.config import RouterConfig
from router_service.engine import Engine
from worker_service.metrics import WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "radixserve-dashboard.json"
METRIC_NAME = re.compile(r"radixserve:[a-zA-Z_][a-zA-Z0-9_]*")
# The sample names each metric type exposes beside its family name.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exposed_names() -> set[str]:
    registries = [
        GatewayMetrics(lambda: "m").registry,
        Engine(RouterConfig()).metrics.registry,
        WorkerMetrics("m", 0, CollectorRegistry()).registry,
    ]
    return {
        family.name + suffix
        for registry in registries
        for family in registry.collect()
        for suffix in SUFFIXES[family.type]
    }


def balanced(expr: str) -> bool:
    depth = {"(": 0, "{": 0, "[": 0}
    closing = {")": "(", "}": "{", "]": "["}
    for char in expr:
        if char in depth:
            depth[char] += 1
        elif char in closing:
            depth[closing[char]] -= 1
            if depth[closing[char]] < 0:
                return False
    return not any(depth.values())


def test_dashboard_is_grafana_json_naming_only_exposed_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert isinstance(dashboard["title"], str) and dashboard["uid"]
    assert isinstance(dashboard["schemaVersion"], int)
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"datasource", "model_name"}
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels) >= 8
    exposed = exposed_names()
    named = set()
    for panel in panels:
        assert panel["type"] and panel["title"] and panel["targets"]
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        for target in panel["targets"]:
            expr = target["expr"]
            names = set(METRIC_NAME.findall(expr))
            assert names, f"{panel['title']}: a query that names no radixserve metric: {expr}"
            assert names <= exposed, f"{panel['title']}: not exported: {sorted(names - exposed)}"
            assert balanced(expr), f"{panel['title']}: unbalanced brackets: {expr}"
            named |= names
    # The main panels the issue asks for are there.
    for needed in ("radixserve:generation_tokens_total", "radixserve:time_to_first_token_seconds_bucket",
                   "radixserve:inter_token_latency_seconds_bucket", "radixserve:kv_cache_usage_perc",
                   "radixserve:prefix_cache_hits_total", "radixserve:num_requests_waiting"):
        assert needed in named
