"""Does the deployment wire the services together the way radixserve needs?

Schemas say a file is well formed; these checks say the gateway, router and worker ranks find
each other: the router lists every rank in rank order on the port that rank listens on, the
ranks agree on WORLD_SIZE and MASTER_ADDR, and only the gateway is reachable from outside.
Each returns a list of errors, empty when the layout is right.
"""

from __future__ import annotations

import subprocess
from typing import Any

PROBE_MODULE = "radixserve.health_probe"
# Every service's TLS settings (files) and the gateway's API tokens: on by default.
TLS_FILE_VARIABLES = ("RADIXSERVE_TLS_CERT", "RADIXSERVE_TLS_KEY", "RADIXSERVE_TLS_CA",
                      "RADIXSERVE_INTERNAL_TOKEN_FILE")
API_TOKEN_VARIABLE = "RADIXSERVE_API_TOKEN_FILE"


def _split_address(address: str) -> tuple[str, int | None]:
    host, _, port = address.rpartition(":")
    return host, int(port) if port.isdigit() else None


def _services_running(project: dict[str, Any], module: str) -> list[str]:
    return sorted(name for name, svc in project["services"].items()
                  if svc.get("command", [])[-1:] == [module])


def compose_topology_errors(project: dict[str, Any]) -> list[str]:
    """Check a resolved Compose project (`docker compose config --format json`)."""
    errors: list[str] = []
    services = project["services"]
    routers = _services_running(project, "router_service")
    gateways = _services_running(project, "gateway_service")
    workers = _services_running(project, "worker_service")
    if not (routers and gateways and workers):
        return [f"need gateway, router and workers; got {gateways}, {routers}, {workers}"]
    for name in routers + gateways + workers:
        svc = services[name]
        env = svc.get("environment") or {}
        if env.get("RADIXSERVE_HOST") != "0.0.0.0":
            errors.append(f"{name}: RADIXSERVE_HOST must be 0.0.0.0 to be reachable")
        if not str(env.get("RADIXSERVE_PORT", "")).isdigit():
            errors.append(f"{name}: RADIXSERVE_PORT is not set (the health probe reads it)")
        if PROBE_MODULE not in (svc.get("healthcheck") or {}).get("test", []):
            errors.append(f"{name}: health check does not run {PROBE_MODULE}")
        if not svc.get("init"):
            errors.append(f"{name}: init: true is missing")
        if not svc.get("stop_grace_period") or svc.get("stop_signal") != "SIGTERM":
            errors.append(f"{name}: graceful stop (SIGTERM, stop_grace_period) is missing")
        if svc.get("ports") and name not in gateways:
            errors.append(f"{name}: only gateways may publish ports")
    backend = {name for name, net in project.get("networks", {}).items() if net.get("internal")}
    for name in routers + workers:
        outside = set(services[name].get("networks") or {}) - backend
        if outside:
            errors.append(f"{name}: on non-internal networks {sorted(outside)}")
    for name in routers + gateways + workers:
        errors += _compose_tls_errors(project, name, gateway=name in gateways)
    for router in routers:
        errors += _router_errors(project, router)
    for gateway in gateways:
        env = services[gateway].get("environment") or {}
        for address in str(env.get("RADIXSERVE_ROUTERS", "")).split(","):
            host, port = _split_address(address)
            if host not in routers or str(port) != services[host]["environment"]["RADIXSERVE_PORT"]:
                errors.append(f"{gateway}: router address {address!r} matches no router")
            elif _condition(services[gateway], host) is None:
                errors.append(f"{gateway}: must depend on {host}")
    return errors


def _compose_tls_errors(project: dict[str, Any], name: str, gateway: bool) -> list[str]:
    """TLS, mTLS and tokens on, from files in a volume that a one-shot service the service waits
    for has written."""
    services = project["services"]
    svc = services[name]
    env = svc.get("environment") or {}
    if str(env.get("RADIXSERVE_MTLS", "")).lower() != "true":
        return [f"{name}: mTLS is not on (RADIXSERVE_MTLS)"]
    errors = []
    for variable in TLS_FILE_VARIABLES + ((API_TOKEN_VARIABLE,) if gateway else ()):
        path = str(env.get(variable, ""))
        mounts = [v for v in svc.get("volumes") or [] if path.startswith(v["target"].rstrip("/") + "/")]
        if not mounts:
            errors.append(f"{name}: {variable}={path!r} is not in a mounted volume")
            continue
        writers = [
            other for other, o in services.items()
            if o.get("restart", "no") == "no"
            and any(v["source"] == mounts[0]["source"] and not v.get("read_only")
                    for v in o.get("volumes") or [])
        ]
        if not any(_condition(svc, w) == "service_completed_successfully" for w in writers):
            errors.append(f"{name}: does not wait for a one-shot service that writes {path}")
    return errors


def _condition(svc: dict[str, Any], dependency: str) -> str | None:
    return ((svc.get("depends_on") or {}).get(dependency) or {}).get("condition")


def _router_errors(project: dict[str, Any], router: str) -> list[str]:
    """The router's worker list: every rank of one TP group, in rank order, on its port."""
    services = project["services"]
    errors: list[str] = []
    addresses = str(services[router]["environment"].get("RADIXSERVE_WORKERS", "")).split(",")
    ranks: list[dict[str, str]] = []
    for rank, address in enumerate(addresses):
        host, port = _split_address(address)
        svc = services.get(host)
        if svc is None or svc.get("command", [])[-1:] != ["worker_service"]:
            errors.append(f"{router}: worker address {address!r} is no worker service")
            continue
        env = svc.get("environment") or {}
        ranks.append(env)
        if str(port) != env.get("RADIXSERVE_PORT"):
            errors.append(f"{router}: {host} listens on {env.get('RADIXSERVE_PORT')}, not {port}")
        if env.get("RANK") != str(rank):
            errors.append(f"{router}: {host} is listed as rank {rank} but has RANK={env.get('RANK')}")
        if _condition(services[router], host) is None:
            errors.append(f"{router}: must depend on {host}")
        if _condition(svc, "model") != "service_completed_successfully":
            errors.append(f"{host}: must wait for the model service to complete")
        if not svc.get("shm_size") and svc.get("ipc") != "host":
            errors.append(f"{host}: needs shm_size (or ipc: host) for torch")
    if errors:
        return errors
    rank0_host = _split_address(addresses[0])[0]
    for env in ranks:
        if env.get("WORLD_SIZE") != str(len(addresses)):
            errors.append(f"{router}: {len(addresses)} ranks but WORLD_SIZE={env.get('WORLD_SIZE')}")
        if env.get("MASTER_ADDR") != rank0_host:
            errors.append(f"{router}: MASTER_ADDR={env.get('MASTER_ADDR')} is not rank 0 ({rank0_host})")
    if len({env.get("MASTER_PORT") for env in ranks}) != 1:
        errors.append(f"{router}: the ranks disagree on MASTER_PORT")
    if len({env.get("RADIXSERVE_DEVICE") for env in ranks}) != 1:
        errors.append(f"{router}: the ranks disagree on RADIXSERVE_DEVICE")
    return errors


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in container.get("env", [])}


def _config(docs: list[dict[str, Any]], name: str) -> dict[str, str]:
    for doc in docs:
        if doc.get("kind") == "ConfigMap" and doc["metadata"]["name"] == name:
            return doc.get("data", {})
    return {}


NAMESPACE = "radixserve"


def lws_router(lws: dict[str, Any]) -> dict[str, Any] | None:
    """The router container of a LeaderWorkerSet's leader pod, if it has one."""
    leader = lws["spec"]["leaderWorkerTemplate"].get("leaderTemplate") or {"spec": {"containers": []}}
    return next((c for c in leader["spec"]["containers"] if c["name"] == "router"), None)


def lws_router_workers(lws: dict[str, Any], leader_address: str) -> list[str]:
    """RADIXSERVE_WORKERS as the leader pod's router command sets it for a group whose leader is
    at `leader_address` (its shell script run with the LWS variables, the router left out)."""
    router = lws_router(lws)
    if router is None:
        return []
    script = " ".join(router.get("args", []))
    script = script.replace("exec python -m router_service", 'printf %s "$RADIXSERVE_WORKERS"')
    size = lws["spec"]["leaderWorkerTemplate"].get("size", 1)
    result = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=10,
                            env={"LWS_LEADER_ADDRESS": leader_address, "LWS_GROUP_SIZE": str(size),
                                 "PATH": "/usr/bin:/bin"})
    return result.stdout.split(",") if result.returncode == 0 else [f"(script failed: {result.stderr})"]


def k8s_worker_errors(docs: list[dict[str, Any]]) -> list[str]:
    """The router's worker list against the LeaderWorkerSet or StatefulSet that makes the ranks."""
    errors: list[str] = []
    addresses = _config(docs, "radixserve-router").get("RADIXSERVE_WORKERS", "").split(",")
    port = _config(docs, "radixserve-worker").get("RADIXSERVE_PORT")
    lws = [d for d in docs if d.get("kind") == "LeaderWorkerSet"]
    sts = [d for d in docs if d.get("kind") == "StatefulSet"]
    if len(lws) + len(sts) != 1:
        return [f"want one worker group (LeaderWorkerSet or StatefulSet), got {len(lws) + len(sts)}"]
    if lws:
        name = lws[0]["metadata"]["name"]
        size = lws[0]["spec"]["leaderWorkerTemplate"].get("size")
        # Group 1 as LWS names it: the leader pod <name>-1, workers <name>-1-<index>, under the
        # LWS's headless Service <name> (LWS_LEADER_ADDRESS is qualified by the namespace); the
        # router in the leader pod names them from the LWS variables.
        domain = f"{name}.{NAMESPACE}"
        expected = [f"{name}-1.{domain}:{port}"] + [f"{name}-1-{i}.{domain}:{port}" for i in range(1, size or 0)]
        addresses = lws_router_workers(lws[0], f"{name}-1.{domain}")
        template = lws[0]["spec"]["leaderWorkerTemplate"]["workerTemplate"]
        script = " ".join(template["spec"]["containers"][0].get("args", []))
        for ours, theirs in (("RANK", "LWS_WORKER_INDEX"), ("WORLD_SIZE", "LWS_GROUP_SIZE"),
                             ("MASTER_ADDR", "LWS_LEADER_ADDRESS")):
            if f'{ours}="${{{theirs}' not in script:
                errors.append(f"{name}: the worker command does not set {ours} from {theirs}")
        if lws[0]["spec"]["leaderWorkerTemplate"].get("restartPolicy") != "RecreateGroupOnPodRestart":
            errors.append(f"{name}: a TP group must be recreated together")
    else:
        name = sts[0]["metadata"]["name"]
        size = sts[0]["spec"].get("replicas")
        expected = [f"{name}-{i}.{sts[0]['spec']['serviceName']}:{port}" for i in range(size or 0)]
        template = sts[0]["spec"]["template"]
        env = _env(template["spec"]["containers"][0])
        if env.get("WORLD_SIZE") != str(size):
            errors.append(f"{name}: replicas {size} but WORLD_SIZE={env.get('WORLD_SIZE')}")
        if env.get("MASTER_ADDR") != expected[0].rpartition(":")[0]:
            errors.append(f"{name}: MASTER_ADDR {env.get('MASTER_ADDR')} is not rank 0")
        if sts[0]["spec"].get("podManagementPolicy") != "Parallel":
            errors.append(f"{name}: ranks must start in parallel (rank 0 waits for the others)")
        service = next((d for d in docs if d.get("kind") == "Service"
                        and d["metadata"]["name"] == sts[0]["spec"]["serviceName"]), None)
        if service is None or service["spec"].get("clusterIP") != "None" \
                or not service["spec"].get("publishNotReadyAddresses"):
            errors.append(f"{name}: needs a headless Service publishing not-ready addresses")
    if addresses != expected:
        errors.append(f"router RADIXSERVE_WORKERS {addresses} != the {name} ranks {expected}")
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    mounts = {m["mountPath"]: m["name"] for m in template["spec"]["containers"][0]["volumeMounts"]}
    shm = volumes.get(mounts.get("/dev/shm", ""), {})
    if (shm.get("emptyDir") or {}).get("medium") != "Memory":
        errors.append(f"{name}: /dev/shm must be a medium: Memory emptyDir")
    return errors


def network_policy_errors(docs: list[dict[str, Any]]) -> list[str]:
    """Default deny; the router only from gateways; the workers only from the router and peers."""
    errors: list[str] = []
    policies = [d for d in docs if d.get("kind") == "NetworkPolicy"]
    if not any(p["spec"].get("podSelector") == {} and not p["spec"].get("ingress")
               and "Ingress" in p["spec"].get("policyTypes", []) for p in policies):
        errors.append("no default-deny ingress policy")
    # A LeaderWorkerSet group's router pod is its leader and runs rank 0 beside the router.
    allowed = {"router": {"gateway", "worker"}, "worker": {"router", "worker"}}
    for component, sources in allowed.items():
        selected = [p for p in policies if p["spec"].get("podSelector", {}).get("matchLabels", {})
                    .get("app.kubernetes.io/component") == component]
        if not selected:
            errors.append(f"no NetworkPolicy selects the {component} pods")
        for policy in selected:
            for rule in policy["spec"].get("ingress", []):
                peers = rule.get("from")
                if not peers:
                    errors.append(f"{policy['metadata']['name']}: a rule admits every source")
                    continue
                for peer in peers:
                    source = (peer.get("podSelector") or {}).get("matchLabels", {}) \
                        .get("app.kubernetes.io/component")
                    if source not in sources or set(peer) != {"podSelector"}:
                        errors.append(f"{policy['metadata']['name']}: admits {peer}")
    return errors
