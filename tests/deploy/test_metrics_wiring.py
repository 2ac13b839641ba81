"""The HTTP API and /metrics ports as the deployment files wire them: in both Kubernetes layouts
each pod's scrape annotation names its `metrics` container port, which is the port its
ConfigMap gives the service; the gateway's HTTP port is a container port and a Service port;
only the metrics ports open to the monitoring namespace. In docker-compose.yml every
long-running service sets its metrics port and labels it, and the gateway publishes HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy_checks import K8S_DIR, ROOT, compose_binary, compose_model, find, kustomization_documents

LAYOUTS = {"leaderworkerset": K8S_DIR, "statefulset": K8S_DIR / "statefulset"}
WORKLOADS = {"Deployment", "StatefulSet", "LeaderWorkerSet"}
COMPONENT_CONFIG = {"gateway": "radixserve-gateway", "router": "radixserve-router", "worker": "radixserve-worker"}


def _pod_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc["spec"]
    if doc["kind"] == "LeaderWorkerSet":
        return [spec["leaderWorkerTemplate"][key] for key in ("leaderTemplate", "workerTemplate")]
    return [spec["template"]]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_k8s_pods_expose_metrics_and_the_gateway_http(layout: str) -> None:
    docs = kustomization_documents(LAYOUTS[layout])
    workloads = [d for d in docs if d["kind"] in WORKLOADS and d["metadata"]["name"] != "radixserve-model"]
    templates = [t for d in workloads for t in _pod_templates(d)]
    configs = {c["envFrom"][0]["configMapRef"]["name"] for t in templates for c in t["spec"]["containers"]}
    assert configs == set(COMPONENT_CONFIG.values())  # every service runs somewhere
    scraped: set[str] = set()
    for template in templates:
        annotations = template["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", template["metadata"]
        for index, container in enumerate(template["spec"]["containers"]):
            config_name = container["envFrom"][0]["configMapRef"]["name"]
            config = find(docs, "ConfigMap", config_name)["data"]
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            metrics_name = next(name for name in ports if name.endswith("metrics"))
            scraped.add(metrics_name)
            assert ports[metrics_name] == int(config["RADIXSERVE_METRICS_PORT"]), config_name
            if index == 0:
                assert int(annotations["prometheus.io/port"]) == ports[metrics_name]
            component = config_name.removeprefix("radixserve-")
            if component == "gateway":
                assert ports["http"] == int(config["RADIXSERVE_HTTP_PORT"])
                service = find(docs, "Service", "radixserve-gateway")
                assert {"name": "http", "port": ports["http"], "targetPort": "http"}.items() <= \
                    next(p for p in service["spec"]["ports"] if p["name"] == "http").items()
    metrics = find(docs, "NetworkPolicy", "radixserve-metrics")
    for rule in metrics["spec"]["ingress"]:
        assert scraped <= {p["port"] for p in rule["ports"]} <= {"metrics", "router-metrics"}
        assert all(set(peer) == {"namespaceSelector"} for peer in rule["from"])


def test_podmonitor_scrapes_the_metrics_port() -> None:
    monitor = yaml.safe_load((K8S_DIR / "monitoring" / "podmonitor.yaml").read_text())
    assert monitor["kind"] == "PodMonitor"
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "radixserve"}
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics", "router-metrics"]


@pytest.mark.skipif(compose_binary() is None, reason="no docker-compose binary")
@pytest.mark.parametrize("profiles", [[], ["gpu"]], ids=["default", "gpu"])
def test_compose_services_expose_metrics_and_the_gateway_http(profiles: list[str]) -> None:
    services = compose_model(Path(ROOT / "docker-compose.yml"), profiles)["services"]
    for name, svc in services.items():
        if not svc.get("healthcheck"):
            continue  # the one-shot model service
        port = svc["environment"]["RADIXSERVE_METRICS_PORT"]
        assert svc["labels"]["prometheus.io/port"] == port and svc["labels"]["prometheus.io/scrape"] == "true"
        assert port in svc.get("expose", []), name
        if name.startswith("gateway"):
            published = {int(p["target"]) for p in svc["ports"]}
            assert int(svc["environment"]["RADIXSERVE_HTTP_PORT"]) in published, name
