"""`replicas: 3` on the LeaderWorkerSet is three model replicas that the gateways find: the
rendered manifests' leader pods (one per group, each with a router naming its own group's ranks)
are what the headless Service `radixserve-router` selects, and a gateway configured by its
ConfigMap, its DNS stubbed to answer the Service's name with those pods' addresses, discovers
exactly three routers."""

from __future__ import annotations

import asyncio
import copy
import socket
from typing import Any

from deploy_checks import K8S_DIR, find, kubectl_binary, kustomization_documents, kustomize
from gateway_service.config import config_from_args
from gateway_service.router_discovery import RouterDiscovery
from topology_checks import NAMESPACE, lws_router_workers

NUM_REPLICAS = 3


def _rendered() -> list[dict[str, Any]]:
    if kubectl_binary() is None:
        return kustomization_documents(K8S_DIR)
    docs, errors = kustomize(K8S_DIR)
    assert errors == []
    return copy.deepcopy(docs)


def _pods(lws: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The pods LWS makes for `lws`, by name, with their labels: group g's leader <name>-g and
    its workers <name>-g-i."""
    name = lws["metadata"]["name"]
    template = lws["spec"]["leaderWorkerTemplate"]
    leader_labels = template["leaderTemplate"]["metadata"]["labels"]
    worker_labels = template["workerTemplate"]["metadata"]["labels"]
    pods = {}
    for group in range(lws["spec"]["replicas"]):
        pods[f"{name}-{group}"] = leader_labels
        for index in range(1, template["size"]):
            pods[f"{name}-{group}-{index}"] = worker_labels
    return pods


def test_three_replicas_are_three_routers_that_the_gateways_discover(monkeypatch) -> None:
    docs = _rendered()
    lws = find(docs, "LeaderWorkerSet", "radixserve-worker")
    lws["spec"]["replicas"] = NUM_REPLICAS
    name = lws["metadata"]["name"]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]

    # The headless Service selects the leader pods, one per group, and reaches their router.
    service = find(docs, "Service", "radixserve-router")
    assert service["spec"]["clusterIP"] == "None"
    selector = service["spec"]["selector"]
    selected = [pod for pod, labels in _pods(lws).items() if selector.items() <= labels.items()]
    assert selected == [f"{name}-{group}" for group in range(NUM_REPLICAS)]
    (port,) = service["spec"]["ports"]
    router = next(c for c in lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
                  if c["name"] == "router")
    assert {"name": port["targetPort"], "containerPort": port["port"]} in router["ports"]

    # Each group's router drives its own group's ranks, rank 0 first.
    for group in range(NUM_REPLICAS):
        domain = f"{name}.{NAMESPACE}"
        assert lws_router_workers(lws, f"{name}-{group}.{domain}") == [
            f"{name}-{group}.{domain}:50060", *(f"{name}-{group}-{i}.{domain}:50060" for i in range(1, size))]

    # A gateway as its ConfigMap configures it, DNS stubbed: the Service's name answers with the
    # addresses of the pods it selects (as the cluster's DNS does for a headless Service).
    env = find(docs, "ConfigMap", "radixserve-gateway")["data"]
    config = config_from_args([], env=env)
    host, _, dns_port = config.router_dns.rpartition(":")
    assert host == service["metadata"]["name"] and int(dns_port) == port["port"]
    pod_ips = {pod: f"10.1.0.{index + 1}" for index, pod in enumerate(selected)}
    real = socket.getaddrinfo

    def getaddrinfo(query, query_port, *args, **kwargs):
        if query != host:
            return real(query, query_port, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (ip, int(query_port)))
                for ip in pod_ips.values()]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    discovery = RouterDiscovery(config.routers, config.router_dns, config.router_dns_interval_s)
    found = asyncio.run(discovery.addresses())
    assert sorted(found) == sorted(f"{ip}:{port['port']}" for ip in pod_ips.values())
    assert len(found) == NUM_REPLICAS
    # Their certificates are checked for the Service's name, which the certificate Job puts in.
    assert {discovery.tls_name(address) for address in found} == {host}


def test_the_gateway_autoscaler_passes_the_schema_and_targets_the_gateways() -> None:
    import yaml

    from deploy_checks import builtin_errors

    (hpa,) = list(yaml.safe_load_all((K8S_DIR / "autoscaling" / "gateway-hpa.yaml").read_text()))
    assert builtin_errors(hpa) == []
    gateway = find(_rendered(), "Deployment", "radixserve-gateway")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", gateway["metadata"]["name"])
    assert hpa["metadata"]["namespace"] == gateway["metadata"]["namespace"]
