"""`radixserve up`: the whole stack as local processes — worker rank(s), router, gateway.

Ports follow one convention: the gateway on P, the router on P+1, worker rank r on P+9+r;
their Prometheus /metrics endpoints the same way from M (gateway M, router M+1, rank r M+9+r);
the OpenAI-compatible HTTP API on its own port; the ranks rendezvous on a free MASTER_PORT.
Each service is started once the ones it depends on report SERVING (bounded waits).
Children's output is prefixed with their name. Ctrl-C or SIGTERM stops the stack (SIGTERM to every child, a bounded wait, SIGKILL to stragglers). Once
serving, a worker rank that exits takes its TP group with it (the other ranks leave on their
own, see `worker_service.peer_watch`): the launcher stops what is left of the group and starts
it again on a fresh rendezvous port, at most `--max-worker-restarts` times in a row without
the group coming back; the router reconnects by itself. Any other child dying stops the stack.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixserve.flags import add_flag, env_name
from radixserve.security import (
    Security,
    SecurityError,
    add_security_flags,
    load_security,
    security_args,
    security_from_args,
)
from radixserve.serving import NO_SECURITY

DEFAULT_MODEL_DIR = "models/smollm2-135m-instruct"
ROUTER_PORT_OFFSET = 1
WORKER_PORT_OFFSET = 9
# Internal services listen on loopback only: only the gateway is public.
INTERNAL_HOST = "127.0.0.1"
# Environment that would override the rank settings the launcher hands each worker.
_RANK_ENV = ("RADIXSERVE_RANK", "RADIXSERVE_WORLD_SIZE", "RADIXSERVE_MASTER_ADDR", "RADIXSERVE_MASTER_PORT")
_PR_SET_PDEATHSIG = 1
# How often the launcher looks at its children and their health.
POLL_INTERVAL_S = 0.25


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str
    cmd: list[str]
    health_address: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StackPlan:
    """Children in start order, grouped: a group starts once the previous one is SERVING."""

    groups: list[list[ChildSpec]]
    gateway_address: str
    http_port: int = 0
    http_host: str = "127.0.0.1"
    # The id the HTTP API serves the model under (the workers report the folder's name).
    model_id: str = ""


class StackFailed(Exception):
    """A child died or never became healthy; the message names it."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="radixserve launcher")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="serve a model locally: worker rank(s), router, gateway")
    add_flag(up, "model", default=DEFAULT_MODEL_DIR, help="model folder")
    add_flag(up, "tp", type=int, default=1, help="tensor-parallel size (worker processes)")
    add_flag(up, "port", type=int, default=50051, help="gateway port; router P+1, worker rank r P+9+r")
    add_flag(up, "host", default="127.0.0.1", help="address the gateway listens on")
    add_flag(up, "http-port", type=int, default=8000,
             help="gateway's OpenAI-compatible HTTP API port (0: off)")
    add_flag(up, "metrics-port", type=int, default=50151,
             help="gateway's /metrics port M; router M+1, worker rank r M+9+r (0: all off)")
    add_flag(up, "device", choices=["cpu", "cuda"], help="worker device (worker default when unset)")
    add_flag(up, "dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
             help="weight and KV dtype; auto: each worker picks bfloat16 on CUDA or a CPU with "
             "AVX512-BF16/AMX, else float32")
    add_flag(up, "kv-cache-mb", type=int, default=1024, help="KV page pool budget per rank, MiB")
    add_flag(up, "startup-timeout-s", type=float, default=300.0,
             help="how long each stage may take to report SERVING")
    add_flag(up, "shutdown-timeout-s", type=float, default=30.0,
             help="how long each stage (gateway, router, workers) gets to exit after SIGTERM "
             "before SIGKILL; the gateway drains its streams meanwhile")
    add_flag(up, "max-worker-restarts", type=int, default=3,
             help="times the worker group is restarted after a rank exits, in a row without "
             "the group serving again; past it the stack stops")
    add_flag(up, "log-level", default="INFO", help="log level of every service")
    # Passed down to every service (the API tokens to the gateway only).
    add_security_flags(up, public=True)
    return parser


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((INTERNAL_HOST, 0))
        return sock.getsockname()[1]


def metrics_ports(metrics_port: int, tp: int) -> tuple[int, int, list[int]]:
    """Gateway, router and per-rank metrics ports from the gateway's (all 0 when it is 0)."""
    if metrics_port == 0:
        return 0, 0, [0] * tp
    return (metrics_port, metrics_port + ROUTER_PORT_OFFSET,
            [metrics_port + WORKER_PORT_OFFSET + rank for rank in range(tp)])


def plan_stack(args: argparse.Namespace, python: str = sys.executable) -> StackPlan:
    router_port = args.port + ROUTER_PORT_OFFSET
    worker_ports = [args.port + WORKER_PORT_OFFSET + rank for rank in range(args.tp)]
    gateway_metrics, router_metrics, _ = metrics_ports(args.metrics_port, args.tp)
    workers = plan_workers(args, python)
    secure = security_args(security_from_args(args))
    router = ChildSpec(
        "router",
        [python, "-m", "router_service", "--host", INTERNAL_HOST, "--port", str(router_port),
         "--workers", ",".join(f"{INTERNAL_HOST}:{p}" for p in worker_ports),
         "--log-level", args.log_level, "--metrics-port", str(router_metrics), *secure],
        f"{INTERNAL_HOST}:{router_port}",
    )
    gateway = ChildSpec(
        "gateway",
        [python, "-m", "gateway_service", "--host", args.host, "--port", str(args.port),
         "--model", args.model, "--routers", f"{INTERNAL_HOST}:{router_port}",
         "--log-level", args.log_level, "--http-port", str(args.http_port),
         "--metrics-port", str(gateway_metrics), *secure,
         *(["--api-token-file", args.api_token_file] if args.api_token_file else [])],
        f"{_reachable(args.host)}:{args.port}",
        # Tokens given on the launcher's command line reach the gateway in its environment,
        # not on a command line that other users can read.
        {env_name("api-tokens"): ",".join(args.api_tokens)} if args.api_tokens else {},
    )
    return StackPlan([workers, [router], [gateway]], gateway.health_address,
                     args.http_port, _reachable(args.host), os.path.basename(os.path.normpath(args.model)))


def plan_workers(args: argparse.Namespace, python: str = sys.executable) -> list[ChildSpec]:
    """The worker ranks, rendezvousing on a port free right now (a restarted group gets a new
    one, so it never meets what is left of the old group's store)."""
    master_port = free_port()
    *_, worker_metrics = metrics_ports(args.metrics_port, args.tp)
    workers = []
    for rank in range(args.tp):
        port = args.port + WORKER_PORT_OFFSET + rank
        cmd = [python, "-m", "worker_service", "--model", args.model, "--host", INTERNAL_HOST,
               "--port", str(port), "--dtype", args.dtype, "--kv-cache-mb", str(args.kv_cache_mb),
               "--log-level", args.log_level, "--metrics-port", str(worker_metrics[rank]),
               *security_args(security_from_args(args))]
        if args.device:
            cmd += ["--device", args.device]
        env = {"RANK": str(rank), "WORLD_SIZE": str(args.tp), "MASTER_ADDR": INTERNAL_HOST,
               "MASTER_PORT": str(master_port)}
        if "OMP_NUM_THREADS" not in os.environ:
            # Ranks share the machine's cores: more threads than cores makes them spin.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.tp))
        workers.append(ChildSpec(f"worker{rank}", cmd, f"{INTERNAL_HOST}:{port}", env))
    return workers


def _reachable(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the launcher dies without cleaning up."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own shutdown path still applies


class Stack:
    """The running children, their prefixed output, and shutdown."""

    def __init__(self, shutdown_timeout_s: float, out=sys.stdout) -> None:
        self.children: dict[str, subprocess.Popen] = {}
        self._shutdown_timeout_s = shutdown_timeout_s
        self._out = out
        self._out_lock = threading.Lock()
        self._readers: list[threading.Thread] = []

    def say(self, text: str) -> None:
        with self._out_lock:
            self._out.write(f"[radixserve] {text}\n")
            self._out.flush()

    def start(self, spec: ChildSpec) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}
        env.update({"PYTHONUNBUFFERED": "1", **spec.env})
        proc = subprocess.Popen(
            spec.cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent,
        )
        self.children[spec.name] = proc
        reader = threading.Thread(target=self._relay, args=(spec.name, proc), daemon=True)
        reader.start()
        self._readers.append(reader)

    def _relay(self, name: str, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._out_lock:
                self._out.write(f"[{name}] {line}\n")
                self._out.flush()

    def dead_child(self) -> tuple[str, int] | None:
        for name, proc in self.children.items():
            code = proc.poll()
            if code is not None:
                return name, code
        return None

    def stop(self, names: list[str] | None = None) -> None:
        """SIGTERM the children named (default: all, gateway first), wait, SIGKILL what is left."""
        children = [(name, proc) for name, proc in self.children.items() if names is None or name in names]
        for _, proc in reversed(children):
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + self._shutdown_timeout_s
        for name, proc in children:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                self.say(f"{name} did not exit after SIGTERM; killing it")
        for _, proc in children:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        if names is None:
            for reader in self._readers:
                reader.join(timeout=2)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def is_serving(address: str, timeout_s: float = 1.0, security: Security = NO_SECURITY) -> bool:
    """Health over TLS (and with a client certificate) when `security` says so; the health
    service asks for no token."""
    with security.channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def _wait_healthy(
    stack: Stack, specs: list[ChildSpec], timeout_s: float, stop: threading.Event, security: Security
) -> None:
    pending = {spec.name: spec.health_address for spec in specs}
    deadline = time.monotonic() + timeout_s
    while pending:
        _check_children(stack)
        if stop.is_set():
            return
        for name, address in list(pending.items()):
            if is_serving(address, security=security):
                stack.say(f"{name} is serving on {address}")
                del pending[name]
        if pending and time.monotonic() > deadline:
            raise StackFailed(f"{', '.join(pending)} not SERVING after {timeout_s:g}s")
        if pending:
            stop.wait(POLL_INTERVAL_S)


def _check_children(stack: Stack) -> None:
    dead = stack.dead_child()
    if dead is not None:
        name, code = dead
        raise StackFailed(f"{name} exited with code {code}")


def run_up(args: argparse.Namespace) -> int:
    if args.tp < 1:
        raise SystemExit("radixserve up: --tp must be >= 1")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        security = load_security(security_from_args(args), public=True)
    except SecurityError as exc:
        raise SystemExit(f"radixserve up: {exc}") from None
    plan = plan_stack(args)
    stack = Stack(args.shutdown_timeout_s)
    try:
        for group in plan.groups:
            for spec in group:
                stack.start(spec)
                stack.say(f"started {spec.name} (pid {stack.children[spec.name].pid}): {' '.join(spec.cmd)}")
            _wait_healthy(stack, group, args.startup_timeout_s, stop, security)
            if stop.is_set():
                break
        else:
            _print_usage(stack, plan, args)
            _supervise(stack, args, plan.groups[0], stop, security)
    except StackFailed as exc:
        stack.say(f"{exc}; stopping the stack")
        _stop_in_order(stack, plan)
        return 1
    stack.say("stopping the stack")
    _stop_in_order(stack, plan)
    stack.say("stopped")
    return 0


def _stop_in_order(stack: Stack, plan: StackPlan) -> None:
    """Gateway first, then router, then workers, each stage waiting for the last: the gateway
    drains its streams while everything behind it still serves them."""
    for group in reversed(plan.groups):
        stack.stop([spec.name for spec in group])
    stack.stop()


def _supervise(
    stack: Stack, args: argparse.Namespace, workers: list[ChildSpec], stop: threading.Event,
    security: Security,
) -> None:
    """Watch the serving stack until `stop`: restart the worker group when a rank exits."""
    worker_names = [spec.name for spec in workers]
    restarts = 0  # in a row, without the group serving in between
    recovering = False
    while not stop.wait(POLL_INTERVAL_S):
        dead = stack.dead_child()
        if dead is not None and dead[0] not in worker_names:
            raise StackFailed(f"{dead[0]} exited with code {dead[1]}")
        if dead is not None:
            if restarts >= args.max_worker_restarts:
                raise StackFailed(f"{dead[0]} exited with code {dead[1]} after "
                                  f"{restarts} worker group restart(s)")
            restarts += 1
            stack.say(f"{dead[0]} exited with code {dead[1]}; restarting the worker group "
                      f"({restarts}/{args.max_worker_restarts})")
            stack.stop(worker_names)
            for spec in plan_workers(args):
                stack.start(spec)
                stack.say(f"started {spec.name} (pid {stack.children[spec.name].pid})")
            recovering = True
        elif recovering and all(is_serving(s.health_address, security=security) for s in workers):
            stack.say("worker group is serving again")
            recovering, restarts = False, 0


def _print_usage(stack: Stack, plan: StackPlan, args: argparse.Namespace) -> None:
    address = plan.gateway_address
    stack.say(f"ready: GenerationService on {address}")
    if plan.http_port:
        stack.say(f"ready: OpenAI-compatible HTTP API on http://{plan.http_host}:{plan.http_port}/v1")
    stack.say("try:")
    transport = f"-cacert {args.tls_ca}" if args.tls_ca else "-plaintext"
    client_tls = f" --tls-ca {args.tls_ca}" if args.tls_ca else ""
    token = curl_auth = ""
    if args.api_token_file or args.api_tokens:
        transport += " -H \"authorization: Bearer $TOKEN\""
        client_tls += " --api-token $TOKEN"
        curl_auth = " -H \"Authorization: Bearer $TOKEN\""
        token = " (TOKEN: one of the API tokens)"
    if plan.http_port:
        scheme, curl_tls = ("https", f" --cacert {args.tls_ca}") if args.tls_cert else ("http", "")
        base = f"{scheme}://{plan.http_host}:{plan.http_port}/v1"
        body = f'{{"model": "{plan.model_id}", "messages": [{{"role": "user", "content": "Hello"}}]}}'
        stack.say(f"  curl{curl_tls}{curl_auth} {base}/chat/completions -H 'Content-Type: application/json' -d '{body}'")
    stack.say(f"  grpcurl {transport} -d '{{\"prompt\": \"Hello\", \"max_tokens\": 16}}' {address} "
              f"radixserve.v1.GenerationService/Generate{token}")
    stack.say(f"  python -m radixserve_client generate \"Hello\" --max-tokens 16 --address {address}{client_tls}")
    stack.say(f"  python -m radixserve_client chat \"What is a radix tree?\" --address {address}{client_tls}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "up":
        return run_up(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
