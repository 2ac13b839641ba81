"""The environments the deployment files give each service, parsed by the service's own flags.

A misspelt `RADIXSERVE_*` name is silently ignored by a service, and a bad value only shows when
the container starts; both are caught here, for docker-compose.yml and for the Kubernetes
ConfigMaps (plus the LeaderWorkerSet wrapper that turns the LWS variables into RANK & co).
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from deploy_checks import K8S_DIR, compose_binary, compose_model, find, kustomization_documents
from flag_checks import SERVICE_MODULES, env_errors

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "docker-compose.yml"
LEADER_ADDRESS = "radixserve-worker-0.radixserve-worker.radixserve"


def _run_lws_wrapper(tmp_path: Path, lws_env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run the LeaderWorkerSet container's command with a stand-in `python` that prints the
    environment it was started with (and its arguments) instead of starting a worker."""
    lws = find(kustomization_documents(K8S_DIR), "LeaderWorkerSet", "radixserve-worker")
    container = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    shim = tmp_path / "bin" / "python"
    shim.parent.mkdir(exist_ok=True)
    shim.write_text('#!/bin/sh\nenv\necho "ARGS=$*"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": f"{shim.parent}:{os.environ['PATH']}", **lws_env}
    return subprocess.run(container["command"] + container["args"], env=env,
                          capture_output=True, text=True, timeout=30)


def _printed_env(stdout: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in stdout.splitlines() if "=" in line)


def _config_maps() -> dict[str, dict[str, str]]:
    docs = kustomization_documents(K8S_DIR)
    return {name: find(docs, "ConfigMap", f"radixserve-{name}")["data"]
            for name in ("worker", "router", "gateway")}


@pytest.fixture(scope="module")
def lws_rank1_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    group = {"LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": LEADER_ADDRESS}
    result = _run_lws_wrapper(tmp_path_factory.mktemp("lws"), group)
    assert result.returncode == 0, result.stderr
    return _printed_env(result.stdout)


def test_lws_wrapper_maps_the_group_variables(lws_rank1_env: dict[str, str]) -> None:
    assert lws_rank1_env["RANK"] == "1"
    assert lws_rank1_env["WORLD_SIZE"] == "2"
    assert lws_rank1_env["MASTER_ADDR"] == LEADER_ADDRESS
    assert lws_rank1_env["ARGS"] == "-m worker_service"


def test_lws_wrapper_refuses_to_start_without_the_group_variables(tmp_path: Path) -> None:
    result = _run_lws_wrapper(tmp_path, {"LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "2"})
    assert result.returncode != 0
    assert "LWS_LEADER_ADDRESS" in result.stderr
    assert "ARGS=" not in result.stdout


@pytest.fixture(scope="module")
def cases(lws_rank1_env: dict[str, str]) -> dict[str, tuple[str, dict[str, str], list[str]]]:
    """label -> (service module, environment, problems found)."""
    envs: dict[str, tuple[str, dict[str, str]]] = {}
    if compose_binary() is not None:
        project = compose_model(COMPOSE_FILE, ["gpu"])
        for name, svc in project["services"].items():
            module = svc["command"][-1]
            if module in SERVICE_MODULES:
                envs[f"compose:{name}"] = (module, svc.get("environment") or {})
    maps = _config_maps()
    lws_env = {k: lws_rank1_env[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    envs["k8s:worker-lws-rank1"] = ("worker_service", maps["worker"] | lws_env)
    sts = find(kustomization_documents(K8S_DIR / "statefulset"), "StatefulSet", "radixserve-worker")
    sts_env = {item["name"]: item.get("value", "1")  # RANK: the pod index, here 1
               for item in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    envs["k8s:worker-statefulset-rank1"] = ("worker_service", maps["worker"] | sts_env)
    envs["k8s:router"] = ("router_service", maps["router"])
    envs["k8s:gateway"] = ("gateway_service", maps["gateway"])
    # Deliberately broken copies: the check must find their problems.
    envs["broken:worker-typo"] = ("worker_service", maps["worker"] | {"RADIXSERVE_KV_CACHE_M": "64"})
    envs["broken:worker-rank"] = ("worker_service", maps["worker"] | lws_env | {"RANK": "2"})
    envs["broken:router-policy"] = ("router_service", maps["router"] | {"RADIXSERVE_POLICY": "fifo"})
    envs["broken:gateway-number"] = ("gateway_service",
                                     maps["gateway"] | {"RADIXSERVE_DEFAULT_MAX_TOKENS": "lots"})
    found: dict[str, tuple[str, dict[str, str], list[str]]] = {}
    for module in SERVICE_MODULES:
        labels = [label for label, (m, _) in envs.items() if m == module]
        results = env_errors(module, [envs[label][1] for label in labels])
        for label, errors in zip(labels, results):
            found[label] = (module, envs[label][1], errors)
    return found


@pytest.mark.timeout(180)
def test_deployment_environments_parse(cases: dict[str, Any]) -> None:
    good = {label: errors for label, (_, _, errors) in cases.items()
            if not label.startswith("broken:")}
    expected = {"k8s:worker-lws-rank1", "k8s:worker-statefulset-rank1", "k8s:router",
                "k8s:gateway"}
    if compose_binary() is not None:
        expected |= {"compose:worker-0", "compose:worker-1", "compose:router", "compose:gateway",
                     "compose:worker-0-gpu", "compose:router-gpu", "compose:gateway-gpu"}
    assert expected <= set(good)
    assert {label: errors for label, errors in good.items() if errors} == {}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("label", "message"),
    [
        ("broken:worker-typo", "RADIXSERVE_KV_CACHE_M is no flag"),
        ("broken:worker-rank", "outside --world-size"),
        ("broken:router-policy", "fifo"),
        ("broken:gateway-number", "lots"),
    ],
)
def test_flag_check_rejects_broken_environments(
    cases: dict[str, Any], label: str, message: str
) -> None:
    errors = cases[label][2]
    assert any(message in error for error in errors), errors
