"""`make compose-test`: the compose stack on a real Docker engine, end to end.

    python deploy/compose_test/run.py [--dry-run] [--keep]

Builds the image, brings docker-compose.yml up as its own project, waits until every service
is healthy, sends a greedy chat through the gateway and checks it against transformers (in the
gateway container: greedy_check.py), SIGKILLs worker rank 1 inside its container (kill_rank.py)
and waits for the TP group to come back on its own (restart policies), checks the same answer
again, and always tears the project down (containers, networks and its model volume; the
image stays for the next run). Before anything it checks that the Docker CLI, the engine
(20.10+), Compose v2 and the base image are there, and says which are missing (exit 2).
`--dry-run` prints the commands it would run without running any. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROJECT = "radixserve-compose-test"
BASE_IMAGE = os.environ.get("PYTHON_IMAGE", "python:3.11-slim")
MIN_ENGINE = (20, 10)
# The long-running services of the default profile, the gateway that answers, the rank to kill.
SERVICES = ("worker-0", "worker-1", "router", "gateway")
GATEWAY = "gateway"
VICTIM = "worker-1"
# Compose variables for the test project: a small KV pool, and a free host port for the
# gateway so that a stack already running on 50051 is left alone.
KV_CACHE_MB = "256"
STARTUP_TIMEOUT_S = 900.0  # includes the model download and conversion on first start
RECOVERY_TIMEOUT_S = 300.0
POLL_INTERVAL_S = 3.0
COMMAND_TIMEOUT_S = 3600.0  # the image build downloads torch
STOP_TIMEOUT_S = 30
EXIT_FAILED, EXIT_MISSING = 1, 2


class Failed(Exception):
    """A step failed; the message says which and why."""


class Shell:
    """Runs commands (or, dry, only prints them), with the compose project's environment."""

    def __init__(self, dry: bool, env: dict[str, str]) -> None:
        self.dry = dry
        self.env = env

    def run(self, argv: list[str], *, stdin: Path | None = None, capture: bool = True,
            check: bool = True, timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
        shown = shlex.join(argv) + (f" < {stdin.relative_to(ROOT)}" if stdin else "")
        print(f"+ {shown}", flush=True)
        if self.dry:
            return subprocess.CompletedProcess(argv, 0, stdout="", stderr="")
        with open(stdin or os.devnull, "rb") as source:
            result = subprocess.run(argv, stdin=source, capture_output=capture, text=True,
                                    env=self.env, timeout=timeout, cwd=ROOT)
        if check and result.returncode != 0:
            detail = (result.stderr or result.stdout or "").strip()[-2000:] if capture else ""
            raise Failed(f"`{shown}` exited {result.returncode}\n{detail}")
        return result


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.strip().lstrip("v").split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def missing_prerequisites(shell: Shell) -> tuple[list[str], list[str]]:
    """(what is missing, the compose command) for a real run: CLI, engine, Compose, base image."""
    def probe(argv: list[str]) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=shell.env,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None

    missing: list[str] = []
    engine = probe(["docker", "version", "--format", "{{.Server.Version}}"])
    if engine is None:
        return ["the Docker CLI (`docker` is not on PATH)"], []
    if engine.returncode != 0 or not engine.stdout.strip():
        reason = (engine.stderr.strip().splitlines() or ["no answer"])[-1]
        return [f"a running Docker engine (`docker version`: {reason})"], []
    if _version(engine.stdout) < MIN_ENGINE:
        missing.append(f"Docker Engine {'.'.join(map(str, MIN_ENGINE))} or newer "
                       f"(this one is {engine.stdout.strip()})")
    compose: list[str] = []
    for candidate in (["docker", "compose"], ["docker-compose"]):
        found = probe(candidate + ["version", "--short"])
        if found is not None and found.returncode == 0 and _version(found.stdout)[:1] >= (2,):
            compose = candidate
            break
    if not compose:
        missing.append("Compose v2 (neither `docker compose` nor `docker-compose` version 2)")
    present = probe(["docker", "image", "inspect", "--format", "{{.Id}}", BASE_IMAGE])
    if present is None or present.returncode != 0:
        print(f"the base image {BASE_IMAGE} is not here; pulling it", flush=True)
        pulled = probe(["docker", "pull", BASE_IMAGE])
        if pulled is None or pulled.returncode != 0:
            reason = ((pulled.stderr if pulled else "") or "timed out").strip().splitlines()[-1:]
            missing.append(f"the base image {BASE_IMAGE} (not present, and `docker pull` failed: "
                           f"{' '.join(reason)}); pull or load it, or set PYTHON_IMAGE to a "
                           f"Python 3.11+ image you have")
    return missing, compose


class Stack:
    """One compose project: the commands of the test, in order."""

    def __init__(self, shell: Shell, compose: list[str]) -> None:
        self.shell = shell
        self.compose = compose + ["-p", PROJECT, "-f", str(COMPOSE_FILE)]

    def run(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return self.shell.run(self.compose + list(args), **kwargs)

    def state(self, service: str) -> tuple[str, str, int]:
        """(status, health, restart count) of the service's container."""
        container = self.run("ps", "-q", service).stdout.strip()
        if self.shell.dry:
            container = f"<{service} container>"
        elif not container:
            return "missing", "", 0
        shown = self.shell.run(["docker", "inspect", "--format",
                                "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}"
                                "{{else}}none{{end}} {{.RestartCount}}", container]).stdout.split()
        if self.shell.dry:
            return "running", "healthy", 0
        return shown[0], shown[1], int(shown[2])

    def wait(self, what: str, done, timeout_s: float) -> None:
        """Poll `done()` (True when finished; raises Failed when it never will) until timeout."""
        print(f"# waiting (up to {timeout_s:.0f} s) until {what}", flush=True)
        if self.shell.dry:
            done()
            return
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise Failed(f"timed out after {timeout_s:.0f} s waiting until {what}")
            time.sleep(POLL_INTERVAL_S)

    def all_healthy(self) -> bool:
        states = {s: self.state(s) for s in SERVICES}
        model = self.run("ps", "--all", "-q", "model").stdout.strip()
        if model:
            shown = self.shell.run(["docker", "inspect", "--format", "{{.State.Status}} "
                                    "{{.State.ExitCode}}", model]).stdout.split()
            if shown[0] == "exited" and shown[1] != "0":
                raise Failed(f"the model service exited {shown[1]}")
        if not self.shell.dry:
            print("  " + ", ".join(f"{s}: {st} {h}" for s, (st, h, _) in states.items()),
                  flush=True)
        return all(st == "running" and h == "healthy" for st, h, _ in states.values())

    def seconds_since_model_ready(self) -> float:
        """Seconds since the model service finished, by the engine's clock (the cold start of
        the long-running services, which start when it has)."""
        if self.shell.dry:
            return 0.0
        model = self.run("ps", "--all", "-q", "model").stdout.strip()
        finished = self.shell.run(["docker", "inspect", "--format", "{{.State.FinishedAt}}",
                                   model]).stdout.strip()
        # RFC 3339 with nanoseconds; fromisoformat takes microseconds at most.
        stamp = re.sub(r"(\.\d{6})\d*", r"\1", finished).replace("Z", "+00:00")
        return time.time() - datetime.fromisoformat(stamp).timestamp()

    def greedy_check(self) -> dict:
        result = self.run("exec", "-T", GATEWAY, "python", "-", stdin=HERE / "greedy_check.py",
                          check=False)
        if self.shell.dry:
            return {"ok": True}
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        if not lines:
            raise Failed(f"the greedy check printed nothing (exit {result.returncode}):\n"
                         f"{result.stderr.strip()[-2000:]}")
        shown = json.loads(lines[-1])
        print(f"  served:    {shown['text']!r} {shown['token_ids']}\n"
              f"  reference: {shown['reference_text']!r} {shown['reference_ids']}", flush=True)
        if not shown["ok"]:
            raise Failed("the greedy answer differs from transformers'")
        return shown


def report(stack: Stack, line: str) -> None:
    """A measured figure: only real runs have any."""
    if not stack.shell.dry:
        print(f"# {line}", flush=True)


def run_test(stack: Stack) -> None:
    stack.run("build", capture=False)
    stack.run("up", "--detach", "--no-build", capture=False)
    started = time.monotonic()
    stack.wait("every service is healthy", stack.all_healthy, STARTUP_TIMEOUT_S)
    report(stack, f"healthy {time.monotonic() - started:.0f} s after `up` returned, "
                  f"{stack.seconds_since_model_ready():.0f} s after the model was ready")
    before = stack.greedy_check()
    restarts = {s: stack.state(s)[2] for s in SERVICES}
    stack.run("exec", "-T", VICTIM, "python", "-", stdin=HERE / "kill_rank.py")
    killed_at = time.monotonic()
    stack.wait(f"{VICTIM} has been restarted",
               lambda: stack.state(VICTIM)[2] > restarts[VICTIM], RECOVERY_TIMEOUT_S)
    stack.wait("every service is healthy again", stack.all_healthy, RECOVERY_TIMEOUT_S)
    after = stack.greedy_check()
    report(stack, f"the group served again {time.monotonic() - killed_at:.0f} s after the kill; "
           f"restarts: " + ", ".join(f"{s} +{stack.state(s)[2] - restarts[s]}" for s in SERVICES))
    if after.get("token_ids") != before.get("token_ids"):
        raise Failed("the answer after the recovery differs from the one before")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    parser.add_argument("--keep", action="store_true", help="leave the project up at the end")
    args = parser.parse_args(argv)
    port, http_port = _free_port(), _free_port()
    # The HTTP port too: the default 8000 may be taken on the machine that runs the test.
    env = dict(os.environ, RADIXSERVE_PUBLISH_PORT=str(port), RADIXSERVE_PUBLISH_HTTP_PORT=str(http_port),
               RADIXSERVE_KV_CACHE_MB=KV_CACHE_MB, PYTHON_IMAGE=BASE_IMAGE)
    shell = Shell(args.dry_run, env)
    compose = ["docker", "compose"]
    if not args.dry_run:
        missing, compose = missing_prerequisites(shell)
        if missing:
            print("compose-test cannot run here; missing:\n" +
                  "\n".join(f"  - {m}" for m in missing), file=sys.stderr)
            return EXIT_MISSING
    stack = Stack(shell, compose)
    try:
        run_test(stack)
    except (Failed, subprocess.TimeoutExpired) as exc:
        print(f"compose-test FAILED: {exc}", file=sys.stderr)
        stack.run("logs", "--no-color", "--tail", "40", capture=False, check=False)
        return EXIT_FAILED
    finally:
        if not args.keep:
            stack.run("down", "--volumes", "--remove-orphans", "--timeout", str(STOP_TIMEOUT_S),
                      capture=False, check=False)
    print("compose-test: dry run, nothing was run" if args.dry_run else "compose-test passed",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
