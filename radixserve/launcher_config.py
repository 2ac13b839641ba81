"""`radixserve up`'s configuration: one frozen value, each field a setting declared once (flag
and `RADIXSERVE_*` variable, see `radixserve.flags`); the settings it shares with the services
are the services' own declarations (`radixserve.shared_flags`), and it passes them down."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from radixserve import flags
from radixserve.flags import setting
from radixserve.security import SecurityConfig, security_settings
from radixserve.shared_flags import (DEVICE, DTYPE, HTTP_PORT, KV_CACHE_MB, LOG_LEVEL, METRICS_PORT, MODEL, PORT,
                                     QUANTIZATION)


@dataclass(frozen=True, slots=True)
class UpConfig:
    model: str = MODEL()
    tp: int = setting(1, "tensor-parallel size: one worker process per rank", min=1)
    port: int = PORT(50051, help="gateway port; the router gets P+1, worker rank r gets P+9+r")
    host: str = setting("127.0.0.1", "address the gateway listens on")
    http_port: int = HTTP_PORT(help="the gateway's OpenAI-compatible HTTP API port (0: off)")
    metrics_port: int = METRICS_PORT(50151, help="Prometheus /metrics of the gateway M; router M+1, worker "
                                     "rank r M+9+r (0: all off)")
    device: str | None = DEVICE(help="worker device (unset: the worker's default, cuda if available)")
    dtype: str = DTYPE()
    quantization: str = QUANTIZATION()
    kv_cache_mb: int = KV_CACHE_MB()
    startup_timeout_s: float = setting(300.0, "seconds each stage may take to report SERVING", above=0)
    shutdown_timeout_s: float = setting(30.0, "seconds each stage (gateway, router, workers) gets to exit "
                                        "after SIGTERM before SIGKILL", min=0)
    max_worker_restarts: int = setting(3, "worker group restarts in a row (without the group serving again "
                                       "in between) before the stack stops", min=0)
    log_level: str = LOG_LEVEL(help="log level of every service")
    # Passed down to every service (the API tokens to the gateway only).
    security: SecurityConfig = security_settings(public=True)

    def __post_init__(self) -> None:
        flags.check(self)


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="radixserve launcher")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="serve a model locally: worker rank(s), router, gateway",
                             description="serve a model locally: worker rank(s), router, gateway")
    flags.add_settings(up, UpConfig, env)
    return parser


def config_from_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> UpConfig:
    """`radixserve up ...` (argv starts with `up`) as a config."""
    return flags.parse_into(UpConfig, build_parser(env), argv)
