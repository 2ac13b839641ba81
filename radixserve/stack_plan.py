"""What `radixserve up` starts: each child's command line, environment and health address,
grouped by kind (a plan only; `radixserve.child_processes` runs it).

Ports follow one convention: the gateway on P, the router on P+1, worker rank r on P+9+r;
their Prometheus /metrics endpoints the same way from M (gateway M, router M+1, rank r M+9+r);
with `--replicas N`, replica k's router on P+1+k and its rank r on P+9+k*tp+r (metrics alike),
its children named with a `_k` suffix from the second replica on; with `--gateways G` the
gateways share P and the HTTP port, and gateway i > 0 has its metrics after every rank's,
on M+9+N*tp+i-1;
the OpenAI-compatible HTTP API on its own port; the ranks rendezvous on a free MASTER_PORT.
Internal services listen on loopback only; settings go down as flags (the router and gateway
settings given to `radixserve up` to the services that declare them), API tokens as the
gateway's environment (command lines are visible to other users).
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from dataclasses import dataclass, field

from radixserve.flags import MAX_PORT, env_name
from radixserve.launcher_config import UpConfig
from radixserve.model_source import GGUF_SUFFIX
from radixserve.security import security_args

ROUTER_PORT_OFFSET = 1
WORKER_PORT_OFFSET = 9
# Internal services listen on loopback only: only the gateway is public.
INTERNAL_HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str
    cmd: list[str]
    health_address: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StackPlan:
    """Children grouped by kind: worker ranks, routers, gateways (the launcher starts them all at
    once and stops them gateways first)."""

    groups: list[list[ChildSpec]]
    gateway_address: str
    http_port: int = 0
    http_host: str = "127.0.0.1"
    # The id the HTTP API serves the model under (the workers report the folder's name).
    model_id: str = ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((INTERNAL_HOST, 0))
        return sock.getsockname()[1]


def metrics_ports(metrics_port: int, tp: int, replica: int = 0) -> tuple[int, int, list[int]]:
    """Gateway, router and per-rank metrics ports of a replica from the gateway's (all 0 when it
    is 0)."""
    if metrics_port == 0:
        return 0, 0, [0] * tp
    return (metrics_port, metrics_port + ROUTER_PORT_OFFSET + replica,
            [metrics_port + WORKER_PORT_OFFSET + replica * tp + rank for rank in range(tp)])


def port_problem(config: UpConfig) -> str | None:
    """Why the ports `config` derives cannot all be listened on (one line naming the flag), or
    None: a derived port past 65535, or two services on one port."""
    if config.port == 0:
        return ("--port 0: the router's and the workers' ports are derived from the gateway's "
                f"(P+{ROUTER_PORT_OFFSET}, P+{WORKER_PORT_OFFSET}+r): give a port")
    owners: dict[int, str] = {}
    for port, owner, _ in _listening_ports(config):
        if port > MAX_PORT:
            return f"{owner} would be port {port}, above {MAX_PORT}: give a lower port"
        if port in owners:
            return f"{owner} and {owners[port]} would both be port {port}: give ports that do not overlap"
        owners[port] = owner
    return None


def port_taken(config: UpConfig) -> str | None:
    """The first of the stack's ports that something on this host already listens on (another
    `radixserve up` left running, say), named with its flag, or None. Checked before anything
    starts: the health checks would otherwise find the other process and call the stack ready,
    its routers and ranks half-sharing ports with strangers."""
    for port, owner, host in _listening_ports(config):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed one's TIME_WAIT is no owner
            try:
                probe.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return (f"{owner}: port {port} on {host} is in use (another radixserve up still running?): "
                            "stop it, or give another --port")
                if exc.errno == errno.EACCES:
                    return f"{owner}: port {port} on {host} needs privileges this user lacks: give a port above 1023"
    return None


def _listening_ports(config: UpConfig) -> list[tuple[int, str, str]]:
    """Every fixed port of the stack, with the flag it derives from and the host it is bound on
    (in plan order): the gateways' on --host, the rest on loopback."""
    public, internal = config.host, INTERNAL_HOST
    found = [(config.port, f"--port {config.port} (the gateway)", public)]
    if config.http_port:
        found.append((config.http_port, f"--http-port {config.http_port}", public))
    for replica in range(config.replicas):
        found.append((config.port + ROUTER_PORT_OFFSET + replica, f"--port {config.port}'s router {replica}", internal))
        found += [(config.port + WORKER_PORT_OFFSET + replica * config.tp + rank,
                   f"--port {config.port}'s worker rank {rank} of replica {replica}", internal)
                  for rank in range(config.tp)]
    if config.metrics_port:
        for replica in range(config.replicas):
            gateway, router, ranks = metrics_ports(config.metrics_port, config.tp, replica)
            if not replica:
                found.append((gateway, f"--metrics-port {config.metrics_port} (the gateway's)", public))
            found.append((router, f"--metrics-port {config.metrics_port}'s router {replica}", internal))
            found += [(port, f"--metrics-port {config.metrics_port}'s worker rank {rank} of replica {replica}",
                       internal) for rank, port in enumerate(ranks)]
        found += [(_gateway_metrics_port(config, index), f"--metrics-port {config.metrics_port}'s gateway {index}",
                   public) for index in range(1, config.gateways)]
    return found


def _gateway_metrics_port(config: UpConfig, index: int) -> int:
    """Gateway `index`'s /metrics port (0: off): the first's M, the others' after every rank's."""
    if not index or not config.metrics_port:
        return config.metrics_port
    return config.metrics_port + WORKER_PORT_OFFSET + config.replicas * config.tp + index - 1


def replica_suffix(replica: int) -> str:
    """How a replica's children are named: the first as without replicas, `_k` after it."""
    return f"_{replica}" if replica else ""


def plan_stack(config: UpConfig, python: str = sys.executable) -> StackPlan:
    secure = security_args(config.security)
    workers: list[ChildSpec] = []
    routers: list[ChildSpec] = []
    for replica in range(config.replicas):
        router_port = config.port + ROUTER_PORT_OFFSET + replica
        worker_ports = [config.port + WORKER_PORT_OFFSET + replica * config.tp + rank for rank in range(config.tp)]
        _, router_metrics, _ = metrics_ports(config.metrics_port, config.tp, replica)
        workers += plan_workers(config, python, replica)
        routers.append(ChildSpec(
            f"router{replica_suffix(replica)}",
            [python, "-m", "router_service", "--host", INTERNAL_HOST, "--port", str(router_port),
             "--workers", ",".join(f"{INTERNAL_HOST}:{p}" for p in worker_ports),
             "--log-level", config.log_level, "--metrics-port", str(router_metrics), *secure,
             *passed_args(config, "router")],
            f"{INTERNAL_HOST}:{router_port}",
        ))
    gateways = [plan_gateway(config, index, routers, python) for index in range(config.gateways)]
    served = {p.flag: p.value for p in config.passed}.get("served-model-name")
    return StackPlan([workers, routers, gateways], gateways[0].health_address,
                     config.http_port, reachable(config.host),
                     served or os.path.basename(os.path.normpath(config.model)).removesuffix(GGUF_SUFFIX))


def plan_gateway(config: UpConfig, index: int, routers: list[ChildSpec], python: str) -> ChildSpec:
    """Gateway `index` of `config.gateways`, knowing every replica's router: each on the same
    gRPC and HTTP ports (they bind them with SO_REUSEPORT); its own /metrics port. (Their health
    is the shared port's: the launcher learns that one of them serves, not which.)"""
    metrics_port = _gateway_metrics_port(config, index)
    api_token_file = config.security.api_token_file
    return ChildSpec(
        f"gateway{index}" if index else "gateway",
        [python, "-m", "gateway_service", "--host", config.host, "--port", str(config.port),
         "--model", config.model, "--routers", ",".join(router.health_address for router in routers),
         "--log-level", config.log_level, "--http-port", str(config.http_port),
         "--metrics-port", str(metrics_port), *security_args(config.security),
         *(["--api-token-file", api_token_file] if api_token_file else []),
         *passed_args(config, "gateway")],
        f"{reachable(config.host)}:{config.port}",
        {env_name("api-tokens"): ",".join(config.security.api_tokens)}
        if config.security.api_tokens else {},
    )


def passed_args(config: UpConfig, child: str) -> list[str]:
    """The router and gateway settings given to `radixserve up` that `child` declares."""
    return [arg for passed in config.passed if child in passed.children for arg in passed.args()]


def plan_workers(config: UpConfig, python: str = sys.executable, replica: int = 0) -> list[ChildSpec]:
    """A replica's worker ranks, rendezvousing on a port free right now (a restarted group gets
    a new one, so it never meets what is left of the old group's store)."""
    master_port = free_port()
    *_, worker_metrics = metrics_ports(config.metrics_port, config.tp, replica)
    workers = []
    for rank in range(config.tp):
        port = config.port + WORKER_PORT_OFFSET + replica * config.tp + rank
        cmd = [python, "-m", "worker_service", "--model", config.model, "--host", INTERNAL_HOST,
               "--port", str(port), "--dtype", config.dtype, "--quantization", config.quantization,
               "--lm-head-quantization", config.lm_head_quantization,
               "--activation-quantization", config.activation_quantization, "--kv-cache-mb",
               str(config.kv_cache_mb), "--log-level", config.log_level, "--metrics-port",
               str(worker_metrics[rank]), "--deterministic" if config.deterministic else "--no-deterministic",
               *security_args(config.security)]
        if config.device:
            cmd += ["--device", config.device]
        env = {"RANK": str(rank), "WORLD_SIZE": str(config.tp), "MASTER_ADDR": INTERNAL_HOST,
               "MASTER_PORT": str(master_port)}
        if "OMP_NUM_THREADS" not in os.environ:
            # Ranks share the machine's cores: more threads than cores makes them spin.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (config.tp * config.replicas)))
        if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
            # The router and gateway run on the same cores, between and during the rank's steps:
            # OpenMP threads that spin between parallel regions (libgomp's default when its
            # threads fit the cores) take the core they need, and a spinning thread that loses
            # its core holds up the region after. Passive threads sleep instead. On a host whose
            # cores are the stack's alone, spinning is faster (docs/flags.md): a policy or spin
            # count in the environment is left as it is.
            env["OMP_WAIT_POLICY"] = "passive"
        workers.append(ChildSpec(f"worker{rank}{replica_suffix(replica)}", cmd, f"{INTERNAL_HOST}:{port}", env))
    return workers


def reachable(host: str) -> str:
    """Where to reach a server listening on `host` (loopback for a wildcard address)."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
