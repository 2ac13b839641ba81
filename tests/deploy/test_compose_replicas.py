"""docker-compose.replicas.yml over docker-compose.yml (as `docker compose -f ... -f ...` merges
them): a second model replica with its own worker group and router, both routers on the
gateway, and certificate names for the new services."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from deploy_checks import COMMAND_TIMEOUT_S, ROOT, compose_binary

pytestmark = pytest.mark.skipif(compose_binary() is None, reason="no docker-compose binary")


def test_the_second_replica_is_its_own_group_router_and_gateway_entry() -> None:
    result = subprocess.run(
        [str(compose_binary()), "--project-directory", str(ROOT), "-f", str(ROOT / "docker-compose.yml"),
         "-f", str(ROOT / "docker-compose.replicas.yml"), "config", "--format", "json"],
        capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
        env={k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ})
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    env = {name: services[name].get("environment", {}) for name in services}
    group = [env["worker-2"], env["worker-3"]]
    assert [e["RANK"] for e in group] == ["0", "1"]
    assert {e["MASTER_ADDR"] for e in group} == {"worker-2"} and {e["WORLD_SIZE"] for e in group} == {"2"}
    assert env["router-1"]["RADIXSERVE_WORKERS"] == \
        f"worker-2:{group[0]['RADIXSERVE_PORT']},worker-3:{group[1]['RADIXSERVE_PORT']}"
    assert env["router"]["RADIXSERVE_WORKERS"] == "worker-0:50060,worker-1:50061"  # replica 0 unchanged
    assert env["gateway"]["RADIXSERVE_ROUTERS"] == "router:50052,router-1:50052"
    hosts = services["certs"]["command"][services["certs"]["command"].index("--hosts") + 1].split(",")
    assert {"router-1", "worker-2", "worker-3"} <= set(hosts)
