"""`radixserve up`: the whole stack as local processes — worker rank(s), router, gateway.

Each stage (workers, router, gateway; `radixserve.stack_plan`) is started once the one before
reports SERVING (bounded waits). Children's output is prefixed with their name. Ctrl-C or
SIGTERM stops the stack, gateway first so that it drains its streams while everything behind
it still serves them. Once serving, a worker rank that exits takes its TP group with it (the
other ranks leave on their own, see `worker_service.peer_watch`): the launcher stops what is
left of the group and starts it again on a fresh rendezvous port, at most
`--max-worker-restarts` times in a row without the group coming back; the router reconnects by
itself. Any other child dying stops the stack.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Sequence

from radixserve.child_processes import Children
from radixserve.health import is_serving
from radixserve.launcher_config import UpConfig, config_from_args
from radixserve.security import Security, SecurityError, load_security
from radixserve.stack_plan import ChildSpec, StackPlan, plan_stack, plan_workers

# How often the launcher looks at its children and their health.
POLL_INTERVAL_S = 0.25


class StackFailed(Exception):
    """A child died or never became healthy; the message names it."""


def run_up(config: UpConfig) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        security = load_security(config.security, public=True)
    except SecurityError as exc:
        raise SystemExit(f"radixserve up: {exc}") from None
    plan = plan_stack(config)
    children = Children(config.shutdown_timeout_s)
    try:
        for group in plan.groups:
            _start(children, group, show_cmd=True)
            _wait_healthy(children, group, config.startup_timeout_s, stop, security)
            if stop.is_set():
                break
        else:
            _print_usage(children, plan, config)
            _supervise(children, config, plan.groups[0], stop, security)
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
    security: Security,
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
            if is_serving(address, security=security):
                children.say(f"{name} is serving on {address}")
                del pending[name]
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


def _supervise(
    children: Children, config: UpConfig, workers: list[ChildSpec], stop: threading.Event,
    security: Security,
) -> None:
    """Watch the serving stack until `stop`: restart the worker group when a rank exits."""
    worker_names = [spec.name for spec in workers]
    restarts = 0  # in a row, without the group serving in between
    recovering = False
    while not stop.wait(POLL_INTERVAL_S):
        dead = children.dead_child()
        if dead is not None and dead[0] not in worker_names:
            raise StackFailed(f"{dead[0]} exited with code {dead[1]}")
        if dead is not None:
            if restarts >= config.max_worker_restarts:
                raise StackFailed(f"{dead[0]} exited with code {dead[1]} after "
                                  f"{restarts} worker group restart(s)")
            restarts += 1
            children.say(f"{dead[0]} exited with code {dead[1]}; restarting the worker group "
                         f"({restarts}/{config.max_worker_restarts})")
            children.stop(worker_names)
            _start(children, plan_workers(config))
            recovering = True
        elif recovering and all(is_serving(s.health_address, security=security) for s in workers):
            children.say("worker group is serving again")
            recovering, restarts = False, 0


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
