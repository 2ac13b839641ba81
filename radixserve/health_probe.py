"""Container health check: exit 0 when a radixserve service answers SERVING, else 1.

    python -m radixserve.health_probe [--address HOST:PORT] [--service NAME] [--timeout-s S]

Used by docker-compose health checks and, with TLS on, by Kubernetes exec probes (their
built-in `grpc:` probes speak plaintext only). Without `--address` it checks
`127.0.0.1:$RADIXSERVE_PORT`, the port the service in the same container listens on, so one
health check line fits every service. It takes the services' TLS flags (`--tls-ca`, and with
`--mtls` `--tls-cert/--tls-key`), also from the same `RADIXSERVE_TLS_*` variables, so in a
service's container it speaks TLS exactly when the service does. The health service asks for
no token. It imports grpc only (not torch), so a probe costs a fraction of a second.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from radixserve import flags
from radixserve.flags import setting
from radixserve.health import probe
from radixserve.security import Security, SecurityConfig, client_credentials, security_settings

PORT_ENV = "RADIXSERVE_PORT"
PROBE_HOST = "127.0.0.1"


def default_address(environ: Mapping[str, str]) -> str | None:
    """`127.0.0.1:$RADIXSERVE_PORT`, or None when the variable is unset or empty."""
    port = environ.get(PORT_ENV, "").strip()
    return f"{PROBE_HOST}:{port}" if port else None


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    address: str | None = setting(lambda: default_address(os.environ),
                                  f"host:port to check (unset: {PROBE_HOST}:${PORT_ENV})")
    service: str = setting("", "health service name to check (empty: the whole server)")
    timeout_s: float = setting(3.0, "deadline of the check in seconds", above=0)
    security: SecurityConfig = security_settings()

    def __post_init__(self) -> None:
        flags.check(self)
        if not self.address:
            raise ValueError(f"give --address or set {PORT_ENV}")


PROGRAM = flags.Program(ProbeConfig, "python -m radixserve.health_probe", __doc__.splitlines()[0])


def main(argv: list[str] | None = None) -> int:
    config = PROGRAM.parse(argv)
    try:
        security = Security(channel_credentials=client_credentials(config.security))
    except ValueError as exc:
        raise SystemExit(f"health_probe: {exc}") from None
    status = probe(config.address, config.service, config.timeout_s, security)
    print(f"{config.address} {config.service or '(server)'}: {status}", file=sys.stderr)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
