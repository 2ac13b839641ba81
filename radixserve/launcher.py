"""`radixserve up`: the whole stack as local processes — worker rank(s), router, gateway.

Every stage (workers, router, gateway; `radixserve.stack_plan`) is started at once and the
launch waits (bounded) until all report SERVING: the router reconnects to workers that are
still loading and the gateway probes routers until one answers, so each stage's startup
overlaps the others' instead of adding to them. Children's output is prefixed with their name. Ctrl-C or
SIGTERM stops the stack, gateway first so that it drains its streams while everything behind
it still serves them. Once serving, a worker rank that exits takes its TP group with it (the
other ranks leave on their own, see `worker_service.peer_watch`): the launcher kills what is
left of the group at once (a frozen rank would never act on SIGTERM) and starts it again on a
fresh rendezvous port; the router reconnects by itself. A router that exits, or a gateway that
fails (exits non-zero or by a signal), is started again the same way (the gateway reconnects to
the router by itself). Each is restarted at most `--max-worker-restarts` times in a row without
serving in between. A gateway that exits 0 (it drained after a SIGTERM) stops the stack.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixserve.architectures import unsupported
from radixserve.child_processes import Children
from radixserve.gguf_check import gguf_header_problem
from radixserve.health import CHECK_TIMEOUT_S, is_serving, probe
from radixserve.health_tls import handshake_error
from radixserve.launcher_config import UpConfig, config_from_args
from radixserve.launcher_token import launch_security
from radixserve.model_source import HF_CONFIG, ModelNotFound, resolve_model
from radixserve.security import Security, SecurityConfig, SecurityError, load_security
from radixserve.stack_plan import (
    ChildSpec, StackPlan, plan_stack, plan_workers, port_problem, port_taken, replica_suffix,
)

# How often the launcher looks at its children and their health.
POLL_INTERVAL_S = 0.25


class StackFailed(Exception):
    """A child died or never became healthy; the message names it."""


def run_up(config: UpConfig) -> int:
    problem = unusable_input(config)
    if problem is not None:
        raise SystemExit(f"radixserve up: {problem}")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    with launch_security(config.security) as secured:
        if secured is not config.security:
            print(f"[radixserve] internal token of this launch: {secured.internal_token_file}",
                  flush=True)
        return _run_stack(dataclasses.replace(config, security=secured), stop)


def unusable_input(config: UpConfig) -> str | None:
    """What makes the stack unable to start, found before anything starts (one line for the
    user, where the workers would end in a traceback), or None. What was asked for is checked
    before what this host holds (a port something listens on), so the answer to a wrong flag
    does not depend on what else runs here."""
    problem = port_problem(config)
    if problem is not None:
        return problem
    try:
        source = resolve_model(config.model)
    except ModelNotFound as exc:
        return (f"--model {exc}: give a model folder (config.json, safetensors, tokenizer), e.g. the "
                "one `make model` prepares, or a GGUF file")
    if source.gguf_path is not None:  # its architecture is checked by the workers
        problem = gguf_header_problem(source.gguf_path)
        if problem is not None:
            return f"--model {config.model}: {problem}"
    else:
        try:
            declared = json.loads((source.folder / HF_CONFIG).read_text()).get("architectures") or []
        except (OSError, ValueError) as exc:
            return f"--model {config.model}: {HF_CONFIG} is unreadable: {exc}"
        refusal = unsupported(declared)
        if refusal is not None:
            return f"--model {config.model}: {refusal}"
    if config.device == "cuda":
        import torch  # only here: the launcher itself needs no torch

        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no visible GPU"
            return f"--device cuda, but this torch ({torch.__version__}) has {build}"
    return port_taken(config)


def _run_stack(config: UpConfig, stop: threading.Event) -> int:
    try:
        security = load_security(config.security, public=True)
    except SecurityError as exc:
        raise SystemExit(f"radixserve up: {exc}") from None
    plan = plan_stack(config)
    children = Children(config.shutdown_timeout_s)
    try:
        everything = [spec for group in plan.groups for spec in group]
        _start(children, everything, show_cmd=True)
        _wait_healthy(children, everything, config.startup_timeout_s, stop, security, config.security)
        if not stop.is_set():
            _print_usage(children, plan, config)
            _supervise(children, config, plan, stop, security)
    except StackFailed as exc:
        children.say(f"{exc}; stopping the stack")
        _stop_in_order(children, plan)
        return 1
    children.say("stopping the stack")
    _stop_in_order(children, plan)
    children.say("stopped")
    return 0


def _start(children: Children, group: list[ChildSpec], show_cmd: bool = False) -> None:
    for spec in group:
        proc = children.start(spec)
        cmd = f": {' '.join(spec.cmd)}" if show_cmd else ""
        children.say(f"started {spec.name} (pid {proc.pid}){cmd}")


def _wait_healthy(
    children: Children, specs: list[ChildSpec], timeout_s: float, stop: threading.Event,
    security: Security, tls: SecurityConfig,
) -> None:
    pending = {spec.name: spec.health_address for spec in specs}
    deadline = time.monotonic() + timeout_s
    while pending:
        dead = children.dead_child()
        if dead is not None:
            raise StackFailed(f"{dead[0]} exited with code {dead[1]}")
        if stop.is_set():
            return
        for name, address in list(pending.items()):
            status = probe(address, security=security)
            if status == "SERVING":
                children.say(f"{name} is serving on {address}")
                del pending[name]
            elif status.startswith("UNREACHABLE"):
                # A handshake that fails now fails for good: say why at once.
                reason = handshake_error(address, tls, CHECK_TIMEOUT_S)
                if reason is not None:
                    raise StackFailed(f"TLS handshake with {name} at {address} failed: {reason}")
        if pending and time.monotonic() > deadline:
            raise StackFailed(f"{', '.join(pending)} not SERVING after {timeout_s:g}s")
        if pending:
            stop.wait(POLL_INTERVAL_S)


def _stop_in_order(children: Children, plan: StackPlan) -> None:
    """Gateway first, then router, then workers, each stage waiting for the last: the gateway
    drains its streams while everything behind it still serves them."""
    for group in reversed(plan.groups):
        children.stop([spec.name for spec in group])
    children.stop()


@dataclass(slots=True)
class _Restartable:
    """Children that are restarted together when one of them exits."""

    what: str  # as the launcher's messages name it
    names: list[str]
    plan: Callable[[], list[ChildSpec]]
    restarts: int = 0  # in a row, without serving in between
    recovering: bool = False


def _supervise(
    children: Children, config: UpConfig, plan: StackPlan, stop: threading.Event,
    security: Security,
) -> None:
    """Watch the serving stack until `stop`: restart the worker group when a rank exits, the
    router or the gateway when it fails; a gateway that exits 0 (it drained after SIGTERM) stops
    the stack."""
    workers, routers, gateways = plan.groups
    units: list[_Restartable] = []
    for replica, router in enumerate(routers):  # each replica's worker group and router alone
        suffix = replica_suffix(replica)
        group = workers[replica * config.tp:(replica + 1) * config.tp]
        units += [_Restartable(f"worker group{suffix}", [s.name for s in group],
                               lambda replica=replica: plan_workers(config, replica=replica)),
                  _Restartable(f"router{suffix}", [router.name], lambda router=router: [router])]
    # Each gateway is restarted alone: the others keep serving on the shared ports meanwhile.
    units += [_Restartable("gateway", [spec.name], lambda spec=spec: [spec]) for spec in gateways]
    specs = {spec.name: spec for group in plan.groups for spec in group}
    while not stop.wait(POLL_INTERVAL_S):
        dead = children.dead_child()
        unit = next((u for u in units if dead is not None and dead[0] in u.names), None)
        if dead is not None and (unit is None or (unit.what == "gateway" and dead[1] == 0)):
            raise StackFailed(f"{dead[0]} exited with code {dead[1]}")
        if dead is not None and unit is not None:
            if unit.restarts >= config.max_worker_restarts:
                raise StackFailed(f"{dead[0]} exited with code {dead[1]} after "
                                  f"{unit.restarts} {unit.what} restart(s)")
            unit.restarts += 1
            children.say(f"{dead[0]} exited with code {dead[1]}; restarting the {unit.what} "
                         f"({unit.restarts}/{config.max_worker_restarts})")
            # What is left of a broken group has nothing to finish (its requests failed with
            # the fault), and a frozen rank would never act on SIGTERM: kill it at once.
            children.kill(unit.names)
            _start(children, unit.plan())
            unit.recovering = True
        for unit in units:
            if unit.recovering and all(is_serving(specs[name].health_address, security=security)
                                       for name in unit.names):
                children.say(f"{unit.what} is serving again")
                unit.recovering, unit.restarts = False, 0


def _print_usage(children: Children, plan: StackPlan, config: UpConfig) -> None:
    address, ca, say = plan.gateway_address, config.security.tls_ca, children.say
    say(f"ready: GenerationService on {address}")
    if plan.http_port:
        say(f"ready: OpenAI-compatible HTTP API on http://{plan.http_host}:{plan.http_port}/v1")
    say("try:")
    transport = f"-cacert {ca}" if ca else "-plaintext"
    client_tls = f" --tls-ca {ca}" if ca else ""
    token = curl_auth = ""
    if config.security.api_token_file or config.security.api_tokens:
        transport += " -H \"authorization: Bearer $TOKEN\""
        client_tls += " --api-token $TOKEN"
        curl_auth = " -H \"Authorization: Bearer $TOKEN\""
        token = " (TOKEN: one of the API tokens)"
    if plan.http_port:
        scheme, curl_tls = ("https", f" --cacert {ca}") if config.security.tls_cert else ("http", "")
        base = f"{scheme}://{plan.http_host}:{plan.http_port}/v1"
        body = f'{{"model": "{plan.model_id}", "messages": [{{"role": "user", "content": "Hello"}}]}}'
        say(f"  curl{curl_tls}{curl_auth} {base}/chat/completions -H 'Content-Type: application/json' -d '{body}'")
    say(f"  grpcurl {transport} -d '{{\"prompt\": \"Hello\", \"max_tokens\": 16}}' {address} "
        f"radixserve.v1.GenerationService/Generate{token}")
    say(f"  python -m radixserve_client generate \"Hello\" --max-tokens 16 --address {address}{client_tls}")
    say(f"  python -m radixserve_client chat \"What is a radix tree?\" --address {address}{client_tls}")


def main(argv: Sequence[str] | None = None) -> int:
    return run_up(config_from_args(argv))


if __name__ == "__main__":
    sys.exit(main())
