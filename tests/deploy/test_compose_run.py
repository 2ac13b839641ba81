"""docker-compose.yml run for real, without a container engine.

Each service of the default profile is started as a local process with exactly the command and
environment Compose resolves for it. Only what a container engine would provide is translated:
service host names resolve to 127.0.0.1, each container port becomes a free loopback port,
0.0.0.0 becomes 127.0.0.1, and the `models` volume becomes a folder that holds a model under
the default model's name (a tiny one with its tokenizer). Services start in `depends_on` order with the file's conditions (completed, started, or
healthy, judged by running the file's own health check command), and a Generate call goes
through the gateway, as does `make compose-test`'s greedy check against transformers (piped
into python the way that test runs it in the gateway container), both over TLS with the API
token that the file's one-shot `certs` service wrote into its volume. So a wrong command, port,
host name or variable in the file fails this test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import ssl
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from constrained_model import make_constrained_model
from deploy_checks import ROOT, compose_binary, compose_model
from procs import ServiceProcesses, free_port
from radixserve.v1 import generation_pb2, generation_pb2_grpc

COMPOSE_FILE = ROOT / "docker-compose.yml"
GREEDY_CHECK = ROOT / "deploy" / "compose_test" / "greedy_check.py"
GREEDY_CHECK_TIMEOUT_S = 180
# Compose variables the file reads (`${VAR:-default}`): a small KV pool and one thread per
# rank keep this test lean on a shared two-core machine.
COMPOSE_VARIABLES = {"RADIXSERVE_KV_CACHE_MB": "64", "RADIXSERVE_NUM_THREADS": "1"}
LOOPBACK = "127.0.0.1"
ANY_ADDRESS = "0.0.0.0"
STARTUP_TIMEOUT_S = 150.0
ONE_SHOT_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 60.0
MAX_TOKENS = 4
# Variables that name a port a service listens on: each becomes a free loopback port.
LISTEN_PORTS = ("RADIXSERVE_PORT", "RADIXSERVE_HTTP_PORT", "RADIXSERVE_METRICS_PORT")


class LocalTopology:
    """Translates a resolved Compose project into local commands and environments."""

    def __init__(self, project: dict[str, Any], volume_root: Path) -> None:
        self.services: dict[str, dict[str, Any]] = project["services"]
        self.hosts = set(self.services) | {s["hostname"] for s in self.services.values()
                                           if s.get("hostname")}
        self.host_service = {s.get("hostname", n): n for n, s in self.services.items()}
        self.host_service.update({n: n for n in self.services})
        self.volume_root = volume_root
        self.ports: dict[tuple[str, int], int] = {}
        for name, svc in self.services.items():
            env = svc.get("environment") or {}
            for key in LISTEN_PORTS:
                if env.get(key):
                    self.ports[(name, int(env[key]))] = free_port()
            if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
                key = (self.host_service[env["MASTER_ADDR"]], int(env["MASTER_PORT"]))
                self.ports.setdefault(key, free_port())

    def _path(self, name: str, text: str) -> str:
        for volume in self.services[name].get("volumes") or []:
            target = volume["target"].rstrip("/")
            if text == target or text.startswith(target + "/"):
                return str(self.volume_root / volume["source"]) + text[len(target):]
        return text

    def _address(self, text: str) -> str:
        host, sep, port = text.rpartition(":")
        if sep and host in self.hosts and port.isdigit():
            return f"{LOOPBACK}:{self.ports[(self.host_service[host], int(port))]}"
        if text in self.hosts:
            return LOOPBACK
        return text

    def environment(self, name: str) -> dict[str, str]:
        env = {k: str(v) for k, v in (self.services[name].get("environment") or {}).items()}
        local: dict[str, str] = {}
        for key, value in env.items():
            if key in LISTEN_PORTS:
                local[key] = str(self.ports[(name, int(value))])
            elif key == "MASTER_PORT":
                owner = self.host_service[env["MASTER_ADDR"]]
                local[key] = str(self.ports[(owner, int(value))])
            elif value == ANY_ADDRESS:
                local[key] = LOOPBACK  # tests serve on loopback only
            else:
                items = [self._path(name, self._address(item)) for item in value.split(",")]
                local[key] = ",".join(items)
        return local

    def command(self, name: str, args: list[str]) -> list[str]:
        local = [self._path(name, arg) for arg in args]
        return [sys.executable, *local[1:]] if local[0] == "python" else local

    def address(self, name: str, variable: str = "RADIXSERVE_PORT") -> str:
        port = int(self.services[name]["environment"][variable])
        return f"{LOOPBACK}:{self.ports[(name, port)]}"


def _start_order(services: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Waves of services whose dependencies are all in earlier waves."""
    done: set[str] = set()
    waves: list[list[str]] = []
    while len(done) < len(services):
        wave = sorted(n for n, s in services.items()
                      if n not in done and set(s.get("depends_on") or {}) <= done)
        assert wave, f"depends_on has a cycle among {set(services) - done}"
        waves.append(wave)
        done |= set(wave)
    return waves


def _is_one_shot(svc: dict[str, Any]) -> bool:
    return svc.get("restart", "no") == "no" and not svc.get("healthcheck")


def _awaited_healthy(services: dict[str, dict[str, Any]]) -> set[str]:
    """Services that another one waits for with `condition: service_healthy`."""
    return {dependency for svc in services.values()
            for dependency, spec in (svc.get("depends_on") or {}).items()
            if spec.get("condition") == "service_healthy"}


def _tls(certs: Path, client_cert: bool = False) -> grpc.ChannelCredentials:
    """Trusting the file's CA; with the services' own certificate as a client one (mTLS)."""
    if not client_cert:
        return grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
    return grpc.ssl_channel_credentials(*(
        (certs / name).read_bytes() for name in ("ca.pem", "server-key.pem", "server.pem")
    ))


def _check_healthy(procs: ServiceProcesses, topology: LocalTopology, name: str) -> None:
    certs = topology.volume_root / "certs"  # written by the file's one-shot `certs` service
    procs.wait_healthy(topology.address(name), timeout_s=STARTUP_TIMEOUT_S,
                       credentials=_tls(certs, client_cert=True))
    check = _run_health_check(topology, name)
    assert check.returncode == 0, f"{name} health check failed: {check.stderr}"


def _run_health_check(topology: LocalTopology, name: str) -> subprocess.CompletedProcess:
    test = topology.services[name]["healthcheck"]["test"]
    assert test[0] == "CMD", test
    env = {**os.environ, "PYTHONPATH": str(ROOT), **topology.environment(name)}
    return subprocess.run(topology.command(name, test[1:]), env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=30)


def _generate(address: str, certs: Path) -> tuple[list[Any], Any]:
    token = (certs / "api-token").read_text().strip()
    metadata = (("authorization", f"Bearer {token}"),)
    with grpc.secure_channel(address, _tls(certs)) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S,
                                 metadata=metadata)
        request = generation_pb2.GenerateRequest(
            messages=[generation_pb2.ChatMessage(role="user", content="Name a colour.")],
            max_tokens=MAX_TOKENS, ignore_eos=True,
            sampling=generation_pb2.SamplingParams(temperature=0.0),
        )
        return list(stub.Generate(request, timeout=CALL_TIMEOUT_S, metadata=metadata)), info


@pytest.mark.skipif(compose_binary() is None, reason="no docker-compose binary")
@pytest.mark.timeout(300)
def test_compose_services_serve_generate(smollm2_dir: Path, tmp_path: Path) -> None:
    project = compose_model(COMPOSE_FILE, env=COMPOSE_VARIABLES)
    # The `models` volume: the prepared model where the model service will look for it.
    volume = tmp_path / "volumes" / "models"
    volume.mkdir(parents=True)
    # Under the default model's name, a tiny random Llama with its tokenizer and chat template:
    # what is checked is the file's wiring, and transformers' greedy reference is the same check
    # on any model.
    make_constrained_model(volume / smollm2_dir.name, smollm2_dir)
    topology = LocalTopology(project, tmp_path / "volumes")

    awaited = _awaited_healthy(topology.services)
    with ServiceProcesses() as procs:
        for wave in _start_order(topology.services):
            for name in wave:
                svc = topology.services[name]
                if _is_one_shot(svc):
                    env = {**os.environ, "PYTHONPATH": str(ROOT), **topology.environment(name)}
                    done = subprocess.run(topology.command(name, svc["command"]), env=env,
                                          cwd=ROOT, capture_output=True, text=True,
                                          timeout=ONE_SHOT_TIMEOUT_S)
                    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
                else:
                    procs.start(name, topology.command(name, svc["command"]),
                                env=topology.environment(name))
            for name in sorted(set(wave) & awaited):
                _check_healthy(procs, topology, name)
        for name, svc in sorted(topology.services.items()):
            if not _is_one_shot(svc):
                _check_healthy(procs, topology, name)

        responses, info = _generate(topology.address("gateway"), topology.volume_root / "certs")
        procs.check_alive()
        greedy = _greedy_check(topology)
        procs.check_alive()

        # Both worker services joined one TP group behind the router.
        assert info.tp_size == 2
        assert info.model_name
        token_ids = [t for r in responses for t in r.token_ids]
        assert len(token_ids) == MAX_TOKENS
        assert "".join(r.text for r in responses)
        last = responses[-1]
        assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == MAX_TOKENS
        assert last.usage.prompt_tokens > 0
        # make compose-test's check: the greedy chat equals transformers' token for token.
        assert greedy.returncode == 0, greedy.stdout + greedy.stderr
        shown = json.loads(greedy.stdout.strip().splitlines()[-1])
        assert shown["ok"] and shown["token_ids"] == shown["reference_ids"]
        assert shown["token_ids"] and shown["text"] == shown["reference_text"]

        # The HTTP API and every service's /metrics are wired as the file says.
        # The HTTP API speaks TLS with the gateway's certificate and wants the API token too.
        certs = topology.volume_root / "certs"
        http = f"https://{topology.address('gateway', 'RADIXSERVE_HTTP_PORT')}"
        token = (certs / "api-token").read_text().strip()
        unauthenticated = httpx.get(f"{http}/v1/models", verify=ssl.create_default_context(cafile=str(certs / "ca.pem")), timeout=CALL_TIMEOUT_S)
        assert unauthenticated.status_code == 401
        models = httpx.get(f"{http}/v1/models", verify=ssl.create_default_context(cafile=str(certs / "ca.pem")), timeout=CALL_TIMEOUT_S,
                           headers={"Authorization": f"Bearer {token}"}).json()
        assert [m["id"] for m in models["data"]] == [smollm2_dir.name]
        for name in ("gateway", "router", "worker-0", "worker-1"):
            url = f"http://{topology.address(name, 'RADIXSERVE_METRICS_PORT')}/metrics"
            names = {f.name for f in text_string_to_metric_families(httpx.get(url, timeout=10).text)}
            assert any(n.startswith("radixserve:") for n in names), (name, sorted(names))

        # Graceful stop as Compose does it: dependents first, the services of one level (the
        # ranks of a group) together, each with its stop signal and grace period. A rank told
        # to stop exits 0; one whose peer vanished first would leave its group with status 3.
        for wave in reversed(_start_order(topology.services)):
            running = [name for name in wave if not _is_one_shot(topology.services[name])]
            for name in running:
                os.killpg(procs.procs[name].pid,
                          getattr(signal, topology.services[name]["stop_signal"]))
            for name in running:
                grace_s = _seconds(topology.services[name]["stop_grace_period"])
                assert procs.procs[name].wait(timeout=grace_s) == 0, f"{name}:\n{procs.tail(name)}"


def _greedy_check(topology: LocalTopology) -> subprocess.CompletedProcess:
    """greedy_check.py with the gateway's environment, fed on stdin as compose-test does."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **topology.environment("gateway")}
    with open(GREEDY_CHECK, "rb") as source:
        return subprocess.run([sys.executable, "-"], stdin=source, env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=GREEDY_CHECK_TIMEOUT_S)


def _seconds(duration: str) -> float:
    """A Compose duration such as `30s` or `1m30s`."""
    total, number = 0.0, ""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0}
    for char in duration:
        if char.isdigit() or char == ".":
            number += char
        else:
            total += float(number) * units[char]
            number = ""
    return total
