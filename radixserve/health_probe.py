"""Container health check: exit 0 when a radixserve service answers SERVING, else 1.

    python -m radixserve.health_probe [--address HOST:PORT] [--service NAME] [--timeout-s S]

Used by docker-compose health checks and, with TLS on, by Kubernetes exec probes (its
built-in `grpc:` probes speak plaintext only). Without `--address` it checks
`127.0.0.1:$RADIXSERVE_PORT`, the port the service in the same container listens on, so one
health check line fits every service. It takes the services' TLS flags (`--tls-ca`, and with
`--mtls` `--tls-cert/--tls-key`), also from the same `RADIXSERVE_TLS_*` variables, so in a
service's container it speaks TLS exactly when the service does. The health service asks for
no token. It imports grpc only (not torch), so a probe costs a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixserve.security import (
    SecurityError,
    add_security_flags,
    client_credentials,
    security_from_args,
)

DEFAULT_TIMEOUT_S = 3.0
PORT_ENV = "RADIXSERVE_PORT"
PROBE_HOST = "127.0.0.1"


def probe(
    address: str,
    service: str = "",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    credentials: grpc.ChannelCredentials | None = None,
) -> str:
    """The health status name that `address` reports for `service` ("" is the whole server),
    over TLS when `credentials` are given.

    Returns "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN", ... or "UNREACHABLE" (with the gRPC
    status code) when the call itself fails.
    """
    channel = (
        grpc.insecure_channel(address) if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return f"UNREACHABLE ({exc.code().name})"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def default_address(environ: Mapping[str, str]) -> str | None:
    """`127.0.0.1:$RADIXSERVE_PORT`, or None when the variable is unset or empty."""
    port = environ.get(PORT_ENV, "").strip()
    return f"{PROBE_HOST}:{port}" if port else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--address",
        default=default_address(os.environ),
        help=f"host:port to check (default: {PROBE_HOST}:${PORT_ENV})",
    )
    parser.add_argument(
        "--service", default="", help="health service name to check (default: the whole server)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
        help="deadline of the check in seconds (default: %(default)s)",
    )
    add_security_flags(parser)
    args = parser.parse_args(argv)
    if not args.address:
        parser.error(f"give --address or set {PORT_ENV}")
    if args.timeout_s <= 0:
        parser.error("--timeout-s must be positive")
    try:
        credentials = client_credentials(security_from_args(args))
    except SecurityError as exc:
        parser.error(str(exc))
    status = probe(args.address, args.service, args.timeout_s, credentials)
    print(f"{args.address} {args.service or '(server)'}: {status}", file=sys.stderr)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
