"""deploy/k8s checked offline: kustomize builds, built-in kinds against the Kubernetes schemas,
the LeaderWorkerSet against its CRD's fields, and the wiring between router and worker ranks."""

from __future__ import annotations

import copy
import functools
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy_checks import (
    K8S_DIR,
    builtin_errors,
    find,
    kubectl_binary,
    kustomization_documents,
    kustomize,
    leaderworkerset_errors,
    manifest_errors,
)
from pod_checks import pod_security_errors, probe_errors
from topology_checks import k8s_worker_errors, lws_router_workers, network_policy_errors

LAYOUTS = {"leaderworkerset": K8S_DIR, "statefulset": K8S_DIR / "statefulset"}
needs_kubectl = pytest.mark.skipif(kubectl_binary() is None, reason="kubectl is not on PATH")


@functools.cache
def _rendered(layout: str) -> tuple[dict[str, Any], ...]:
    """Rendered by kustomize where kubectl is there, else the listed files as they are
    (once per layout: kubectl takes a second or more on a busy machine)."""
    if kubectl_binary() is None:
        return tuple(kustomization_documents(LAYOUTS[layout]))
    docs, errors = kustomize(LAYOUTS[layout])
    assert errors == []
    return tuple(docs)


def _documents(layout: str) -> list[dict[str, Any]]:
    """A copy of the layout's documents, free to change."""
    return copy.deepcopy(list(_rendered(layout)))


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout_docs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return _documents(request.param)


def _lws() -> dict[str, Any]:
    return find(kustomization_documents(K8S_DIR), "LeaderWorkerSet", "radixserve-worker")


# --- kustomize ---------------------------------------------------------------------------------

@needs_kubectl
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kustomize_builds(layout: str) -> None:
    docs, errors = kustomize(LAYOUTS[layout])
    assert errors == []
    kinds = {doc["kind"] for doc in docs}
    assert {"Namespace", "ConfigMap", "PersistentVolumeClaim", "Job", "Deployment", "Service",
            "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    assert ("LeaderWorkerSet" if layout == "leaderworkerset" else "StatefulSet") in kinds
    assert all(doc["metadata"].get("namespace") == "radixserve"
               for doc in docs if doc["kind"] != "Namespace")


@needs_kubectl
def test_kustomize_rejects_a_missing_resource(tmp_path: Path) -> None:
    broken = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, broken)
    assert kustomize(broken)[1] == []
    (broken / "base" / "gateway.yaml").unlink()
    assert kustomize(broken)[1] != []
    assert kustomize(broken / "statefulset")[1] != []


# --- schemas -----------------------------------------------------------------------------------

def test_every_manifest_passes_the_schemas(layout_docs: list[dict[str, Any]]) -> None:
    assert manifest_errors(layout_docs) == []


def _break(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy with `value` put at the dotted `path` (list indexes as numbers); None deletes."""
    broken = copy.deepcopy(doc)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node: Any = broken
    for key in parents:
        node = node[key]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return broken


@pytest.mark.parametrize(
    ("kind", "name", "path", "value"),
    [
        ("Deployment", "radixserve-gateway",
         "spec.template.spec.containers.0.ports.0.containerPort", "fifty-thousand"),
        # An exec probe's command is a list of strings.
        ("Deployment", "radixserve-router",
         "spec.template.spec.containers.0.readinessProbe.exec.command", "python"),
        ("Deployment", "radixserve-router", "spec.selector", None),
        ("Deployment", "radixserve-router", "spec.replica", 1),
        ("Service", "radixserve-gateway", "spec.ports.0.port", "50051"),
        ("PodDisruptionBudget", "radixserve-gateway", "spec.minAvailable", [1]),
        ("Job", "radixserve-model", "spec.template.spec.containers.0.command", "python"),
        ("NetworkPolicy", "radixserve-worker", "spec.ingress.0.ports.0.protocol", 6),
        ("ConfigMap", "radixserve-router", "data.RADIXSERVE_MAX_QUEUE", 512),
    ],
    ids=["port-type", "probe-command-type", "no-selector", "unknown-field", "service-port-type",
         "pdb-type", "command-type", "protocol-type", "configmap-value-type"],
)
def test_schema_check_rejects_broken_copies(kind: str, name: str, path: str, value: Any) -> None:
    # The router Deployment is the StatefulSet layout's (the other runs it in the LWS leader).
    doc = find(kustomization_documents(K8S_DIR / "statefulset"), kind, name)
    assert builtin_errors(doc) == []
    assert builtin_errors(_break(doc, path, value)) != []


# --- LeaderWorkerSet ----------------------------------------------------------------------------

def test_leaderworkerset_has_the_required_fields() -> None:
    lws = _lws()
    assert leaderworkerset_errors(lws) == []
    template = lws["spec"]["leaderWorkerTemplate"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert template["size"] == 2
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("spec.leaderWorkerTemplate.size", None, "size"),
        ("spec.leaderWorkerTemplate.size", "2", "size"),
        ("spec.leaderWorkerTemplate.size", 0, "size"),
        ("apiVersion", "leaderworkerset.x-k8s.io/v1alpha1", "apiVersion"),
        ("spec.leaderWorkerTemplate.restartPolicy", "Always", "restartPolicy"),
        ("spec.leaderWorkerTemplate.workerTemplate", None, "workerTemplate is missing"),
        ("spec.leaderWorkerTemplate.workerTemplate.spec.containers.0.image", None, "no image"),
        ("spec.leaderWorkerTemplate.workerTemplate.spec.containers.0.ports.0.containerPort",
         "50060", "containerPort"),
        ("spec.leaderWorkerTemplate.workerTemplate.spec.volumes.1.emptyDir.medium", 1, "medium"),
        ("spec.leaderWorkerTemplate.groupSize", 2, "unknown field"),
        ("spec.startupPolicy", "Whenever", "startupPolicy"),
        ("spec.leaderWorkerTemplate", None, "leaderWorkerTemplate is missing"),
    ],
)
def test_leaderworkerset_check_rejects_broken_copies(path: str, value: Any, message: str) -> None:
    errors = leaderworkerset_errors(_break(_lws(), path, value))
    assert any(message in error for error in errors), errors


# --- wiring -------------------------------------------------------------------------------------

def test_router_lists_every_rank_in_order(layout_docs: list[dict[str, Any]]) -> None:
    assert k8s_worker_errors(layout_docs) == []


@pytest.mark.parametrize(
    ("kind", "path", "value", "message"),
    [
        ("LeaderWorkerSet", "spec.leaderWorkerTemplate.leaderTemplate.spec.containers.1.args",
         ['export RADIXSERVE_WORKERS="$LWS_LEADER_ADDRESS:50060" && exec python -m router_service'],
         "RADIXSERVE_WORKERS"),
        ("LeaderWorkerSet", "spec.leaderWorkerTemplate.restartPolicy", "None", "recreated"),
        ("LeaderWorkerSet", "spec.leaderWorkerTemplate.workerTemplate.spec.containers.0.args",
         ["exec python -m worker_service"], "RANK"),
        ("LeaderWorkerSet", "spec.leaderWorkerTemplate.workerTemplate.spec.volumes.1.emptyDir",
         {}, "/dev/shm"),
        ("StatefulSet", "spec.replicas", 3, "WORLD_SIZE"),
        ("StatefulSet", "spec.podManagementPolicy", "OrderedReady", "parallel"),
    ],
)
def test_wiring_check_rejects_broken_copies(kind: str, path: str, value: Any, message: str) -> None:
    layout = "leaderworkerset" if kind == "LeaderWorkerSet" else "statefulset"
    docs = _documents(layout)
    broken = [_break(doc, path, value) if doc["kind"] == kind else doc for doc in docs]
    errors = k8s_worker_errors(broken)
    assert any(message in error for error in errors), errors


def test_network_policies_keep_router_and_workers_private(
    layout_docs: list[dict[str, Any]],
) -> None:
    assert network_policy_errors(layout_docs) == []
    worker = find(layout_docs, "NetworkPolicy", "radixserve-worker")
    opened = _break(worker, "spec.ingress.0.from", None)
    docs = [opened if doc is worker else doc for doc in layout_docs]
    assert any("every source" in error for error in network_policy_errors(docs))


def _pod_specs(docs: list[dict[str, Any]]):
    for doc in docs:
        if doc["kind"] not in {"Deployment", "StatefulSet", "LeaderWorkerSet"}:
            continue
        spec = doc["spec"]
        if doc["kind"] == "LeaderWorkerSet":
            for key in ("leaderTemplate", "workerTemplate"):
                yield f"{doc['metadata']['name']} {key}", spec["leaderWorkerTemplate"][key]["spec"]
        else:
            yield doc["metadata"]["name"], spec["template"]["spec"]


def test_probes_and_shutdown(layout_docs: list[dict[str, Any]]) -> None:
    """Every long-running container has startup, readiness and liveness probes that run the
    health probe module (kubelet's own gRPC probes cannot speak TLS), on its own port."""
    configs = {d["metadata"]["name"]: d["data"] for d in layout_docs if d["kind"] == "ConfigMap"}
    for name, pod in _pod_specs(layout_docs):
        assert pod.get("enableServiceLinks") is False, name
        for container in pod["containers"]:
            port = container["ports"][0]["containerPort"]
            env = configs[container["envFrom"][0]["configMapRef"]["name"]]
            assert env["RADIXSERVE_PORT"] == str(port), name  # the probe checks that port
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                command = container[probe]["exec"]["command"]
                assert command[:3] == ["python", "-m", "radixserve.health_probe"], (name, probe)


def test_tls_is_on_everywhere(layout_docs: list[dict[str, Any]]) -> None:
    """Every service mounts the TLS Secret at /certs, its settings point there, and the Job that
    makes a development Secret names every host that one service calls another by."""
    configs = {d["metadata"]["name"]: d["data"] for d in layout_docs if d["kind"] == "ConfigMap"}
    for name, pod in _pod_specs(layout_docs):
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"], name
        for container in pod["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert secrets.get(mounts.get("/certs")) == "radixserve-tls", name
            env = configs[container["envFrom"][0]["configMapRef"]["name"]]
            assert env["RADIXSERVE_MTLS"] == "true", name
            for key in ("RADIXSERVE_TLS_CERT", "RADIXSERVE_TLS_KEY", "RADIXSERVE_TLS_CA",
                        "RADIXSERVE_INTERNAL_TOKEN_FILE"):
                assert env[key].startswith("/certs/"), (name, key)
    assert configs["radixserve-gateway"]["RADIXSERVE_API_TOKEN_FILE"].startswith("/certs/")
    job = find(layout_docs, "Job", "radixserve-certs")
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["python", "-m", "radixserve.k8s_secret"]
    names = {h.strip() for h in command[command.index("--hosts") + 1].split(",")}
    lws = [d for d in layout_docs if d["kind"] == "LeaderWorkerSet"]
    workers = (lws_router_workers(lws[0], "radixserve-worker-0.radixserve-worker.radixserve") if lws
               else configs["radixserve-router"]["RADIXSERVE_WORKERS"].split(","))
    gateway = configs["radixserve-gateway"]
    # Routers found by DNS are called by address, their certificate checked for the name.
    called = [*workers, *filter(None, gateway["RADIXSERVE_ROUTERS"].split(",")), gateway["RADIXSERVE_ROUTER_DNS"]]
    for address in called:
        host = address.rpartition(":")[0]
        wildcard = "*." + host.partition(".")[2]
        assert host in names or wildcard in names, f"no certificate name covers {host}"


# --- pods: security context and start-up probes ------------------------------------------------

def test_pods_meet_the_restricted_standard(layout_docs: list[dict[str, Any]]) -> None:
    assert pod_security_errors(layout_docs) == []
    assert probe_errors(layout_docs) == []


GATEWAY_POD = "spec.template.spec"
LWS_POD = "spec.leaderWorkerTemplate.workerTemplate.spec"


@pytest.mark.parametrize(
    ("kind", "path", "value", "message"),
    [
        ("Job", f"{GATEWAY_POD}.securityContext.seccompProfile", None, "seccompProfile"),
        ("Job", f"{GATEWAY_POD}.containers.0.securityContext.readOnlyRootFilesystem", None,
         "readOnlyRootFilesystem"),
        ("Deployment", f"{GATEWAY_POD}.containers.0.securityContext.allowPrivilegeEscalation",
         True, "allowPrivilegeEscalation"),
        ("Deployment", f"{GATEWAY_POD}.securityContext.runAsUser", 0, "runAsUser 0"),
        ("Deployment", f"{GATEWAY_POD}.hostNetwork", True, "hostNetwork"),
        ("LeaderWorkerSet", f"{LWS_POD}.initContainers.0.securityContext.capabilities.drop", [],
         "drop ALL"),
        ("LeaderWorkerSet", f"{LWS_POD}.securityContext.runAsNonRoot", None, "runAsNonRoot"),
        ("Namespace", "metadata.labels", {}, "restricted"),
    ],
    ids=["seccomp", "writable-root", "privilege-escalation", "root", "host-network",
         "capabilities", "non-root", "namespace-label"],
)
def test_pod_security_check_rejects_broken_copies(
    kind: str, path: str, value: Any, message: str
) -> None:
    docs = _documents("leaderworkerset")
    broken = [_break(doc, path, value) if doc["kind"] == kind else doc for doc in docs]
    errors = pod_security_errors(broken)
    assert any(message in error for error in errors), errors


@pytest.mark.parametrize(
    ("kind", "path", "value", "message"),
    [
        ("Deployment", f"{GATEWAY_POD}.containers.0.startupProbe.periodSeconds", 5, "late"),
        ("LeaderWorkerSet", f"{LWS_POD}.containers.0.startupProbe.failureThreshold", 60,
         "startup allowance 120 s"),
        ("LeaderWorkerSet", f"{LWS_POD}.containers.0.startupProbe", None, "no startupProbe"),
    ],
    ids=["slow-probe", "short-allowance", "no-probe"],
)
def test_probe_check_rejects_broken_copies(kind: str, path: str, value: Any, message: str) -> None:
    docs = _documents("leaderworkerset")
    broken = [_break(doc, path, value) if doc["kind"] == kind else doc for doc in docs]
    errors = probe_errors(broken)
    assert any(message in error for error in errors), errors


def test_yaml_files_parse() -> None:
    for path in sorted(K8S_DIR.rglob("*.yaml")):
        assert list(yaml.safe_load_all(path.read_text())), path
