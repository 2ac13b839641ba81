"""docker-compose.yml checked offline with the Compose v2 binary (no container engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from compose_policy_checks import policy_errors
from deploy_checks import ROOT, compose_binary, compose_errors, compose_model
from topology_checks import compose_topology_errors

COMPOSE_FILE = ROOT / "docker-compose.yml"
DEFAULT_SERVICES = {"model", "certs", "worker-0", "worker-1", "router", "gateway"}
GPU_SERVICES = {"worker-0-gpu", "worker-1-gpu", "router-gpu", "gateway-gpu"}
# The model service, the one that builds the image the others use.
MODEL_BUILD = "  model:\n    <<: *image\n    build: *build\n"
HEALTHCHECK_END = "    start_period: 300s\n"

pytestmark = pytest.mark.skipif(compose_binary() is None, reason="no docker-compose binary")


def _broken_copy(tmp_path: Path, old: str, new: str) -> Path:
    text = COMPOSE_FILE.read_text()
    assert old in text, f"the file no longer contains {old!r}: update this test"
    copy = tmp_path / "docker-compose.yml"
    copy.write_text(text.replace(old, new, 1))
    return copy


@pytest.mark.parametrize("profiles", [[], ["gpu"]], ids=["default", "gpu"])
def test_compose_config_accepts_our_file(profiles: list[str]) -> None:
    assert compose_errors(COMPOSE_FILE, profiles) == []
    project = compose_model(COMPOSE_FILE, profiles)
    expected = DEFAULT_SERVICES | (GPU_SERVICES if profiles else set())
    assert set(project["services"]) == expected
    assert compose_topology_errors(project) == []
    assert policy_errors(project) == []


def test_a_plain_copy_passes(tmp_path: Path) -> None:
    # The broken copies below live in tmp_path too: this shows their errors come from the break.
    assert compose_errors(_broken_copy(tmp_path, "name: radixserve", "name: radixserve")) == []


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('"${RADIXSERVE_PUBLISH_PORT:-50051}:50051"', '"${RADIXSERVE_PUBLISH_PORT:-50051}:grpc"',
         "invalid containerPort"),
        (MODEL_BUILD, "  model:\n    pull_policy: missing\n", "neither an image nor a build"),
        ("      worker-1:\n        condition: service_started",
         "      worker-2:\n        condition: service_started", "undefined service"),
        ("condition: service_completed_successfully", "condition: service_done", "condition"),
        ("    retries: 3\n", "    retries: three\n", "retries"),
    ],
    ids=["port-type", "missing-image", "undefined-dependency", "bad-condition", "retries-type"],
)
def test_compose_config_rejects_broken_copies(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    errors = compose_errors(_broken_copy(tmp_path, old, new))
    assert any(message in error for error in errors), errors


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("RADIXSERVE_WORKERS: worker-0:50060,worker-1:50061",
         "RADIXSERVE_WORKERS: worker-0:50060,worker-1:50060", "listens on 50061"),
        ("RADIXSERVE_WORKERS: worker-0:50060,worker-1:50061",
         "RADIXSERVE_WORKERS: worker-1:50061,worker-0:50060", "listed as rank 0"),
        ('  WORLD_SIZE: "2"', '  WORLD_SIZE: "3"', "WORLD_SIZE=3"),
        ("RADIXSERVE_ROUTERS: router:50052", "RADIXSERVE_ROUTERS: router:50051", "matches no router"),
        ("  RADIXSERVE_HOST: 0.0.0.0\n  RADIXSERVE_PORT: \"50052\"",
         "  RADIXSERVE_HOST: 127.0.0.1\n  RADIXSERVE_PORT: \"50052\"", "0.0.0.0"),
        ("  networks: [backend]\n", "  networks: [backend, frontend]\n", "non-internal"),
        ('  RADIXSERVE_MTLS: "true"', '  RADIXSERVE_MTLS: "false"', "mTLS is not on"),
        ("  RADIXSERVE_API_TOKEN_FILE: /certs/api-token",
         "  RADIXSERVE_API_TOKEN_FILE: /etc/api-token", "not in a mounted volume"),
        ("    depends_on:\n      certs:\n        condition: service_completed_successfully\n      worker-0:",
         "    depends_on:\n      worker-0:", "does not wait for a one-shot"),
    ],
    ids=["wrong-port", "rank-order", "world-size", "router-port", "loopback-host", "network",
         "no-mtls", "token-outside-volume", "no-wait-for-certs"],
)
def test_topology_check_rejects_miswired_copies(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    copy = _broken_copy(tmp_path, old, new)
    assert compose_errors(copy) == []  # still a valid Compose file ...
    errors = compose_topology_errors(compose_model(copy))
    assert any(message in error for error in errors), errors  # ... but wired wrong


@pytest.mark.parametrize(
    ("profiles", "old", "new", "message"),
    [
        # Defect 2: a health check field that Docker Engine < 25 refuses.
        ([], HEALTHCHECK_END, HEALTHCHECK_END + "    start_interval: 2s\n", "Engine 25.0+"),
        # Defect 4: every service building the same tag (the classic builder builds it each time).
        ([], "x-service: &service\n  <<: *image\n",
         "x-service: &service\n  <<: *image\n  build: *build\n", "built by 5 services"),
        (["gpu"], "x-gpu-worker: &gpu-worker\n  <<: *worker\n",
         "x-gpu-worker: &gpu-worker\n  <<: *worker\n  build: *build\n", "built by 2 services"),
        ([], MODEL_BUILD, "  model:\n    <<: *image\n", "built by no service"),
        # Defect 8: tiers gated on each other's health checks, a probe interval each.
        ([], "      worker-1:\n        condition: service_started",
         "      worker-1:\n        condition: service_healthy", "waits for worker-1's health"),
        # Self-healing: a rank that exits must come back.
        ([], "  worker-0:\n    <<: *cpu-worker\n",
         "  worker-0:\n    <<: *cpu-worker\n    restart: on-failure\n", "worker-0: restart"),
        ([], "x-service: &service\n  <<: *image\n  init: true\n  restart: unless-stopped\n",
         "x-service: &service\n  <<: *image\n  init: true\n  restart: \"no\"\n",
         "restart: no"),
        ([], '    networks: [egress]\n    restart: "no"\n',
         "    networks: [egress]\n    restart: always\n", "must not restart"),
    ],
    ids=["start-interval", "build-per-service", "gpu-build-twice", "no-build", "healthy-chain",
         "worker-on-failure", "no-restart", "one-shot-restarts"],
)
def test_policy_check_rejects_broken_copies(
    tmp_path: Path, profiles: list[str], old: str, new: str, message: str
) -> None:
    copy = _broken_copy(tmp_path, old, new)
    assert compose_errors(copy, profiles) == []  # a valid Compose file ...
    errors = policy_errors(compose_model(copy, profiles))
    assert any(message in error for error in errors), errors  # ... that fails on a real engine
