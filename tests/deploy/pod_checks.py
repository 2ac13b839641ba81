"""The pods of the Kubernetes manifests: security context and start-up probes.

Every pod meets the "restricted" Pod Security Standard, which the namespace enforces (so a
pod that does not would be refused at apply time, on a real cluster only): non-root, no
privilege escalation, every capability dropped, the runtime's seccomp profile, no host
namespaces; and ours on top: a read-only root filesystem. Start-up probes ask often enough
that a service is noticed ready within seconds, with room for a slow CPU start.
Each check returns a list of errors, empty when the manifests are right.
"""

from __future__ import annotations

from typing import Any

RESTRICTED_LABEL = "pod-security.kubernetes.io/enforce"
SECCOMP_TYPES = {"RuntimeDefault", "Localhost"}
HOST_NAMESPACES = ("hostNetwork", "hostPID", "hostIPC")
# A start-up probe every 2 s at most (Kubernetes' own default is 10 s: up to 10 s late per tier).
STARTUP_PERIOD_MAX_S = 2
# Workers load their shard and meet every rank; on CPU that can take minutes.
WORKER_STARTUP_ALLOWANCE_S = 300
PROBE_DEFAULT_PERIOD_S, PROBE_DEFAULT_FAILURES = 10, 3
POD_OWNERS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}


def pod_templates(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(name, pod template) of every workload, LeaderWorkerSet templates included."""
    found = []
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in POD_OWNERS:
            found.append((name, doc["spec"]["template"]))
        elif doc["kind"] == "LeaderWorkerSet":
            template = doc["spec"]["leaderWorkerTemplate"]
            found += [(f"{name} {key}", template[key])
                      for key in ("leaderTemplate", "workerTemplate") if key in template]
    return found


def _container_errors(where: str, pod_context: dict[str, Any],
                      container: dict[str, Any]) -> list[str]:
    own = container.get("securityContext") or {}
    setting = lambda key: own.get(key, pod_context.get(key))  # noqa: E731 (container wins)
    where = f"{where} container {container.get('name')!r}"
    errors = []
    if setting("runAsNonRoot") is not True:
        errors.append(f"{where}: runAsNonRoot must be true")
    if setting("runAsUser") == 0:
        errors.append(f"{where}: runs as root (runAsUser 0)")
    if own.get("allowPrivilegeEscalation") is not False:
        errors.append(f"{where}: allowPrivilegeEscalation must be false")
    if own.get("privileged"):
        errors.append(f"{where}: privileged")
    if "ALL" not in ((own.get("capabilities") or {}).get("drop") or []):
        errors.append(f"{where}: capabilities must drop ALL")
    if ((setting("seccompProfile") or {}).get("type")) not in SECCOMP_TYPES:
        errors.append(f"{where}: seccompProfile must be RuntimeDefault or Localhost")
    if own.get("readOnlyRootFilesystem") is not True:
        errors.append(f"{where}: readOnlyRootFilesystem must be true")
    return errors


def pod_security_errors(docs: list[dict[str, Any]]) -> list[str]:
    errors: list[str] = []
    for namespace in (d for d in docs if d["kind"] == "Namespace"):
        if (namespace["metadata"].get("labels") or {}).get(RESTRICTED_LABEL) != "restricted":
            errors.append(f"Namespace/{namespace['metadata']['name']}: {RESTRICTED_LABEL} "
                          f"must be restricted")
    for where, template in pod_templates(docs):
        pod = template["spec"]
        errors += [f"{where}: {key}" for key in HOST_NAMESPACES if pod.get(key)]
        context = pod.get("securityContext") or {}
        for container in pod.get("initContainers", []) + pod["containers"]:
            errors += _container_errors(where, context, container)
    return errors


def probe_errors(docs: list[dict[str, Any]]) -> list[str]:
    """Start-up probes of long-running containers: frequent, with room for a slow start."""
    errors: list[str] = []
    for where, template in pod_templates(docs):
        if template["spec"].get("restartPolicy") in {"OnFailure", "Never"}:
            continue  # a Job's pod runs to completion: nothing to probe
        is_worker = (template.get("metadata") or {}).get("labels", {}) \
            .get("app.kubernetes.io/component") == "worker"
        for container in template["spec"]["containers"]:
            startup = container.get("startupProbe")
            if startup is None:
                errors.append(f"{where} {container['name']}: no startupProbe")
                continue
            period = startup.get("periodSeconds", PROBE_DEFAULT_PERIOD_S)
            allowance = period * startup.get("failureThreshold", PROBE_DEFAULT_FAILURES)
            if period > STARTUP_PERIOD_MAX_S:
                errors.append(f"{where} {container['name']}: startupProbe every {period} s "
                              f"notices readiness up to {period} s late (at most "
                              f"{STARTUP_PERIOD_MAX_S} s)")
            if is_worker and allowance < WORKER_STARTUP_ALLOWANCE_S:
                errors.append(f"{where} {container['name']}: startup allowance {allowance} s "
                              f"< {WORKER_STARTUP_ALLOWANCE_S} s for loading on CPU")
    return errors
