"""The router's configuration: one frozen value, built once from flags and `RADIXSERVE_*`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.flags import add_flag
from radixserve.security import (
    SecurityConfig,
    SecurityError,
    add_security_flags,
    security_from_args,
)
from router_service.admission import Policy

LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50052
    # Worker addresses in rank order.
    workers: tuple[str, ...] = ("127.0.0.1:50060",)
    # 0: use the smallest page count the workers report.
    max_pages: int = 0
    max_batch_tokens: int = 2048
    max_running_requests: int = 64
    max_queue: int = 512
    policy: Policy = Policy.LPM
    reconnect_interval_s: float = 1.0
    # How long one GetWorkerInfo call may take while (re)connecting.
    connect_timeout_s: float = 5.0
    # How long every rank together may take to answer one step before the router gives up on
    # the group (UNAVAILABLE, NOT_SERVING, reconnect): generous for a full prefill chunk on CPU.
    step_timeout_s: float = 60.0
    # Longest caller request_id accepted (UTF-8 bytes): it travels in every DecodeTask entry.
    # Above the gateway's own limit plus the suffix it appends; its own name, so that the
    # gateway's RADIXSERVE_MAX_REQUEST_ID_LEN never tightens it under a shared environment.
    max_request_id_bytes: int = 512
    log_level: str = "INFO"
    # Prometheus /metrics port (0: off). The launcher's convention: the gRPC port + 100.
    metrics_port: int = 50152
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("at least one worker address is needed")
        if self.max_pages < 0:
            raise ValueError("max_pages must be >= 0")
        if self.max_running_requests < 1 or self.max_batch_tokens < 1:
            raise ValueError("max_running_requests and max_batch_tokens must be >= 1")
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError("metrics_port must be in [0, 65535] (0: off)")
        if self.reconnect_interval_s <= 0:
            raise ValueError("reconnect_interval_s must be > 0")
        if self.step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be > 0")
        if self.max_request_id_bytes < 0:
            raise ValueError("max_request_id_bytes must be >= 0")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m router_service",
        description="radixserve router: prefix cache, page allocator and batch scheduler in "
        "front of the tensor-parallel worker ranks.",
    )
    defaults = RouterConfig()
    add_flag(parser, "host", default=defaults.host, help="address to listen on")
    add_flag(parser, "port", type=int, default=defaults.port, help="port to listen on")
    add_flag(
        parser, "workers", type=list, default=list(defaults.workers),
        help="comma-separated worker addresses, in rank order",
    )
    add_flag(
        parser, "max-pages", type=int, default=defaults.max_pages,
        help="cap on KV pages (0: the smallest count the workers report)",
    )
    add_flag(
        parser, "max-batch-tokens", type=int, default=defaults.max_batch_tokens,
        help="tokens per step (decodes plus prefill chunks)",
    )
    add_flag(
        parser, "max-running-requests", type=int, default=defaults.max_running_requests,
        help="requests in the running batch at most",
    )
    add_flag(
        parser, "max-queue", type=int, default=defaults.max_queue,
        help="waiting requests before new ones get RESOURCE_EXHAUSTED",
    )
    add_flag(
        parser, "policy", default=defaults.policy.value, choices=[p.value for p in Policy],
        help="queue order: lpm (longest cached prefix first) or fcfs (arrival)",
    )
    add_flag(
        parser, "reconnect-interval-s", type=float, default=defaults.reconnect_interval_s,
        help="seconds between attempts to reach the workers while they are down",
    )
    add_flag(
        parser, "connect-timeout-s", type=float, default=defaults.connect_timeout_s,
        help="seconds one worker may take to answer GetWorkerInfo while connecting",
    )
    add_flag(
        parser, "step-timeout-s", type=float, default=defaults.step_timeout_s,
        help="seconds every worker rank may take to answer one step; past it the in-flight "
        "requests fail with UNAVAILABLE and the router reconnects",
    )
    add_flag(
        parser, "max-request-id-bytes", type=int, default=defaults.max_request_id_bytes,
        help="longest request_id accepted, in UTF-8 bytes",
    )
    add_flag(parser, "log-level", default=defaults.log_level, choices=LOG_LEVELS, help="log level")
    add_flag(
        parser, "metrics-port", type=int, default=defaults.metrics_port,
        help="port of the Prometheus /metrics endpoint (0: off)",
    )
    add_security_flags(parser)
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> RouterConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _config(args)
    except (ValueError, SecurityError) as exc:
        parser.error(str(exc))


def _config(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        host=args.host,
        port=args.port,
        workers=tuple(args.workers),
        max_pages=args.max_pages,
        max_batch_tokens=args.max_batch_tokens,
        max_running_requests=args.max_running_requests,
        max_queue=args.max_queue,
        policy=Policy(args.policy),
        reconnect_interval_s=args.reconnect_interval_s,
        connect_timeout_s=args.connect_timeout_s,
        step_timeout_s=args.step_timeout_s,
        max_request_id_bytes=args.max_request_id_bytes,
        log_level=args.log_level,
        metrics_port=args.metrics_port,
        security=security_from_args(args),
    )
