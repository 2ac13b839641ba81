"""`make compose-test`'s script (deploy/compose_test/run.py) without a Docker engine: the
commands its dry run prints, and a whole run against a fake `docker` that logs every call and
answers like an engine would, so that the real code path (prerequisites, waits, restart
detection, the answer check, teardown on failure too) runs here."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from deploy_checks import ROOT, compose_binary, compose_model

SCRIPT = ROOT / "deploy" / "compose_test" / "run.py"
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROJECT = ["-p", "radixserve-compose-test", "-f", str(COMPOSE_FILE)]
RUN_TIMEOUT_S = 60

# A fake `docker`: logs argv (and what came on stdin) as JSON lines to $FAKE_DOCKER_LOG and
# answers from $FAKE_DOCKER_MODE: "ok", "no-engine", "old-engine", "no-compose", "no-base-image",
# "wrong-answer". Worker-1's restart count goes up once kill_rank.py has been piped into it.
FAKE_DOCKER = r'''
import json, os, sys
args = sys.argv[1:]
mode = os.environ["FAKE_DOCKER_MODE"]
log = os.environ["FAKE_DOCKER_LOG"]
stdin = "" if sys.stdin.isatty() else sys.stdin.read()
with open(log, "a") as f:
    f.write(json.dumps({"argv": args, "stdin": stdin[:200]}) + "\n")
calls = [json.loads(line) for line in open(log)]
killed = any("kill_rank" in c["stdin"] for c in calls)
if args[:1] == ["version"]:
    if mode == "no-engine":
        sys.exit("Cannot connect to the Docker daemon at unix:///var/run/docker.sock.")
    print("19.03.15" if mode == "old-engine" else "24.0.7")
elif args[:2] == ["compose", "version"]:
    if mode == "no-compose":
        sys.exit("docker: 'compose' is not a docker command.")
    print("v2.24.6")
elif args[:2] == ["image", "inspect"] or args[:1] == ["pull"]:
    if mode == "no-base-image":
        sys.exit("Error response from daemon: pull access denied for python")
    print("sha256:0123")
elif args[:1] == ["inspect"]:
    container = args[-1]
    if "FinishedAt" in args[2]:
        print("2026-01-01T00:00:00.123456789Z")
    elif container == "cid-model":
        print("exited 0")
    else:
        print("running healthy", 1 if container == "cid-worker-1" and killed else 0)
elif args[:1] == ["compose"]:
    command = args[5:]
    if command[:1] == ["ps"]:
        print("cid-" + command[-1])
    elif command[:1] == ["exec"] and "greedy_check" in stdin:
        ids = [2, 3] if mode == "wrong-answer" else [1, 2]
        print(json.dumps({"ok": mode != "wrong-answer", "text": "Paris", "token_ids": ids,
                          "reference_text": "Paris", "reference_ids": [1, 2]}))
        sys.exit(1 if mode == "wrong-answer" else 0)
'''


def _commands(output: str) -> list[list[str]]:
    return [shlex.split(line[2:].split(" < ")[0]) for line in output.splitlines()
            if line.startswith("+ ")]


def _index(commands: list[list[str]], *words: str) -> int:
    return next(i for i, c in enumerate(commands) if c[-len(words):] == list(words)
                or c[:len(words)] == list(words) or _tail_after_project(c)[:len(words)] == list(words))


def _tail_after_project(command: list[str]) -> list[str]:
    return command[2 + len(PROJECT):] if command[:2] == ["docker", "compose"] else command


def test_dry_run_prints_the_test_in_order() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, cwd=ROOT, env={"PATH": ""})
    assert done.returncode == 0, done.stderr
    assert "nothing was run" in done.stdout
    lines = [line for line in done.stdout.splitlines() if line.startswith("+ ")]
    commands = _commands(done.stdout)
    compose = [_tail_after_project(c) for c in commands if c[:2] == ["docker", "compose"]]
    assert all(c[2:2 + len(PROJECT)] == PROJECT for c in commands if c[:2] == ["docker", "compose"])
    assert compose[0] == ["build"]
    assert compose[1] == ["up", "--detach", "--no-build"]
    assert compose[-1] == ["down", "--volumes", "--remove-orphans", "--timeout", "30"]
    execs = [(i, line) for i, line in enumerate(lines) if " exec -T " in line]
    assert [line.split(" exec -T ")[1] for _, line in execs] == [
        "gateway python - < deploy/compose_test/greedy_check.py",
        "worker-1 python - < deploy/compose_test/kill_rank.py",
        "gateway python - < deploy/compose_test/greedy_check.py",
    ]
    # Health is polled before the first check, restarts and health between kill and re-check.
    first_check, kill, second_check = (i for i, _ in execs)
    polled = lambda a, b: {_tail_after_project(c)[-1] for c in commands[a:b]  # noqa: E731
                           if _tail_after_project(c)[:2] == ["ps", "-q"]}
    assert polled(1, first_check) == {"worker-0", "worker-1", "router", "gateway"}
    assert polled(kill, second_check) == {"worker-0", "worker-1", "router", "gateway"}


@pytest.mark.skipif(compose_binary() is None, reason="no docker-compose binary")
def test_script_services_are_the_compose_files() -> None:
    """The services it waits for, the gateway it asks and the rank it kills are the file's."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import run as compose_test
    finally:
        sys.path.remove(str(SCRIPT.parent))
    services = compose_model(COMPOSE_FILE)["services"]
    long_running = {n for n, s in services.items() if s.get("healthcheck")}
    assert set(compose_test.SERVICES) == long_running
    assert services[compose_test.GATEWAY]["command"][-1] == "gateway_service"
    assert services[compose_test.VICTIM]["command"][-1] == "worker_service"
    assert services[compose_test.VICTIM]["restart"] in {"always", "unless-stopped"}
    assert compose_test.COMPOSE_FILE == COMPOSE_FILE


def _run_with_fake_docker(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess,
                                                              list[dict]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    # -S: no site packages to scan, so each of the ~40 calls starts in milliseconds.
    docker.write_text(f"#!{sys.executable} -S\n{FAKE_DOCKER}")
    docker.chmod(docker.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "docker.log"
    log.touch()
    env = {"PATH": str(bin_dir), "FAKE_DOCKER_MODE": mode, "FAKE_DOCKER_LOG": str(log)}
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, cwd=ROOT, env=env)
    return done, [json.loads(line) for line in log.read_text().splitlines()]


def test_a_whole_run_against_a_fake_engine(tmp_path: Path) -> None:
    done, calls = _run_with_fake_docker(tmp_path, "ok")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compose-test passed" in done.stdout
    assert "s after the model was ready" in done.stdout
    assert "the group served again" in done.stdout
    assert "worker-1 +1" in done.stdout
    compose = [_tail_after_project(["docker", *c["argv"]]) for c in calls
               if c["argv"][:1] == ["compose"] and c["argv"][1:2] != ["version"]]
    assert compose[0] == ["build"] and compose[-1][0] == "down"
    piped = [c["stdin"] for c in calls if c["stdin"]]
    assert len(piped) == 3
    assert "python greedy_check.py" in piped[0] and "python greedy_check.py" in piped[2]
    assert "python kill_rank.py" in piped[1]


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("no-engine", "a running Docker engine (`docker version`: Cannot connect"),
        ("old-engine", "Docker Engine 20.10 or newer (this one is 19.03.15)"),
        ("no-compose", "Compose v2"),
        ("no-base-image", "the base image python:3.11-slim (not present, and `docker pull` failed"),
    ],
)
def test_says_what_is_missing(tmp_path: Path, mode: str, message: str) -> None:
    done, calls = _run_with_fake_docker(tmp_path, mode)
    assert done.returncode == 2
    assert "compose-test cannot run here; missing:" in done.stderr
    assert message in done.stderr
    assert not any(c["argv"][:1] == ["compose"] and "build" in c["argv"] for c in calls)


def test_says_when_docker_is_not_installed(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, cwd=ROOT, env={"PATH": str(tmp_path)})
    assert done.returncode == 2
    assert "the Docker CLI (`docker` is not on PATH)" in done.stderr


def test_a_wrong_answer_fails_and_still_tears_down(tmp_path: Path) -> None:
    done, calls = _run_with_fake_docker(tmp_path, "wrong-answer")
    assert done.returncode == 1
    assert "differs from transformers'" in done.stderr
    tails = [c["argv"][5:6] for c in calls if c["argv"][:1] == ["compose"]]
    assert tails[-2:] == [["logs"], ["down"]]
    assert not any("kill_rank" in c["stdin"] for c in calls)


def test_kill_rank_kills_only_the_rank(tmp_path: Path) -> None:
    """kill_rank.py, piped into python as in the container, SIGKILLs `python -m MODULE`."""
    (tmp_path / "fake_rank.py").write_text("import time\ntime.sleep(60)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    rank = subprocess.Popen([sys.executable, "-m", "fake_rank"], cwd=tmp_path, env=env)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kill = ROOT / "deploy" / "compose_test" / "kill_rank.py"
        with open(kill, "rb") as source:
            done = subprocess.run([sys.executable, "-", "fake_rank"], stdin=source,
                                  capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert f"pid {rank.pid}" in done.stdout
        assert rank.wait(timeout=10) == -9
        assert bystander.poll() is None
        with open(kill, "rb") as source:
            again = subprocess.run([sys.executable, "-", "fake_rank"], stdin=source,
                                   capture_output=True, text=True, timeout=30)
        assert again.returncode == 1
        assert "no `python -m fake_rank` process here" in again.stderr
    finally:
        for proc in (rank, bystander):
            proc.kill()
            proc.wait(timeout=10)
