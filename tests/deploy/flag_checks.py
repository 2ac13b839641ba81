"""Check deployment environments against the services' real flag parsers (see flag_driver.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).resolve().parent / "flag_driver.py"
SERVICE_MODULES = ("worker_service", "router_service", "gateway_service")
DRIVER_TIMEOUT_S = 120


def env_errors(module: str, envs: list[dict[str, str]]) -> list[list[str]]:
    """For each environment, the problems `module` would have starting with it (empty: none)."""
    if module not in SERVICE_MODULES:
        raise ValueError(f"not a service module: {module}")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_")}
    result = subprocess.run(
        [sys.executable, str(DRIVER), module], input=json.dumps(envs), capture_output=True,
        text=True, cwd=ROOT, env=clean | {"PYTHONPATH": str(ROOT)}, timeout=DRIVER_TIMEOUT_S,
    )
    if result.returncode != 0:
        raise RuntimeError(f"flag driver failed for {module}:\n{result.stderr}")
    return json.loads(result.stdout)
