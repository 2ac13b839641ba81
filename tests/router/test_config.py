"""Router flags: every agreed flag exists, the environment fills defaults, bad values fail."""

from __future__ import annotations

import subprocess

import pytest

from procs import PYTHON, ROOT
from router_service.config import RouterConfig, config_from_args
from router_service.core.scheduler import Policy

AGREED_FLAGS = [
    "--host", "--port", "--workers", "--max-pages", "--max-batch-tokens",
    "--max-running-requests", "--max-queue", "--policy", "--reconnect-interval-s", "--log-level",
]


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_from_args([]) == RouterConfig()
    monkeypatch.setenv("RADIXSERVE_MAX_QUEUE", "7")
    monkeypatch.setenv("RADIXSERVE_WORKERS", "a:1, b:2")
    config = config_from_args(["--policy", "fcfs", "--max-queue", "9", "--max-pages", "100"])
    assert config.max_queue == 9  # the command line wins over the environment
    assert config.workers == ("a:1", "b:2")
    assert (config.policy, config.max_pages) == (Policy.FCFS, 100)
    with pytest.raises(SystemExit):
        config_from_args(["--max-batch-tokens", "0"])
    with pytest.raises(SystemExit):
        config_from_args(["--policy", "random"])


@pytest.mark.parametrize("workers, named", [
    ("127.0.0.1", "--workers must be host:port, got '127.0.0.1'"),
    ("a:1,b:99999", "--workers must be host:port, got 'b:99999'"),
    ("http://a:1", "--workers must be host:port"),
    ("a:1,b:2,a:1", "--workers names a:1 more than once"),  # two ranks cannot share one process
])
def test_a_worker_address_that_cannot_be_a_rank_is_refused_at_start(workers, named, capsys) -> None:
    with pytest.raises(SystemExit):
        config_from_args(["--workers", workers])
    assert named in capsys.readouterr().err
    with pytest.raises(ValueError, match="--workers"):
        RouterConfig(workers=tuple(workers.split(",")))


@pytest.mark.timeout(60)
def test_help_documents_every_flag() -> None:
    result = subprocess.run(
        [PYTHON, "-m", "router_service", "--help"], cwd=ROOT, capture_output=True, text=True,
        timeout=60, check=True,
    )
    for flag in AGREED_FLAGS:
        assert flag in result.stdout
    assert "RADIXSERVE_MAX_BATCH_TOKENS" in result.stdout
