"""Build a service's config from given environments, the way the service does at start-up.

    python tests/deploy/flag_driver.py worker_service < envs.json > errors.json

Reads a JSON list of environments (each a name -> value object) and writes, for each, the list
of problems: `RADIXSERVE_*` variables that name no flag of the service (a typo there is
silently ignored by the service, so it is worth catching), and the error the service's own
config building reports (a bad number, an unknown choice, a rank outside the world size).
It runs in its own process because the services read their flags from `os.environ`.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys

from radixserve.flags import ENV_PREFIX, flags_of


def problems(module: str, env: dict[str, str]) -> list[str]:
    os.environ.clear()
    os.environ.update(env)
    config = importlib.import_module(f"{module}.config")
    errors: list[str] = []
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            known = {flag.env for flag in flags_of(config.PROGRAM.config)}
            errors += [f"{module}: {name} is no flag of the service"
                       for name in sorted(env) if name.startswith(ENV_PREFIX) and name not in known]
            config.PROGRAM.parse([])
    except SystemExit:
        errors.append(f"{module}: {stderr.getvalue().strip().splitlines()[-1]}")
    return errors


def main() -> None:
    module = sys.argv[1]
    base = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    envs = json.load(sys.stdin)
    json.dump([problems(module, base | env) for env in envs], sys.stdout)


if __name__ == "__main__":
    main()
