"""The gateway's frozen configuration, built once from flags and `RADIXSERVE_*` variables."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway_service.validation import RequestLimits
from radixserve.flags import add_flag
from radixserve.security import (
    SecurityConfig,
    SecurityError,
    add_security_flags,
    security_from_args,
)

DEFAULT_MODEL_DIR = "models/smollm2-135m-instruct"


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    model: str = DEFAULT_MODEL_DIR
    # Router addresses (one per model replica).
    routers: tuple[str, ...] = ("127.0.0.1:50052",)
    # max_tokens when a request leaves it unset (then capped by what the context leaves).
    default_max_tokens: int = 256
    # How many leading prompt token ids decide which router a request goes to.
    affinity_tokens: int = 64
    # How often routers are asked for GetServerInfo (health and failover order).
    probe_interval_s: float = 2.0
    # Timeout of one GetServerInfo probe.
    probe_timeout_s: float = 2.0
    # Grace period for open streams when the gateway is asked to stop.
    shutdown_grace_s: float = 20.0
    log_level: str = "INFO"
    # The OpenAI-compatible HTTP API's port (0: off); it listens on `host` too.
    http_port: int = 8000
    # Choices one HTTP request may ask for (n, times the prompts of a completions batch).
    max_choices: int = 16
    # Prometheus /metrics port (0: off). The launcher's convention: the gRPC port + 100.
    metrics_port: int = 50151
    # A constraint that takes longer to compile is rejected (INVALID_ARGUMENT).
    constraint_timeout_s: float = 2.0
    # Distinct constraints kept compiled.
    constraint_cache_size: int = 256
    # Threads that compile constraints (off the event loop).
    constraint_threads: int = 2
    # Threads that tokenize, apply chat templates and detokenize, off the event loop.
    tokenizer_threads: int = 2
    limits: RequestLimits = field(default_factory=RequestLimits)
    security: SecurityConfig = field(default_factory=SecurityConfig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gateway_service", description="radixserve gateway (GenerationService)"
    )
    d = GatewayConfig()
    add_flag(parser, "host", default=d.host, help="address to listen on")
    add_flag(parser, "port", type=int, default=d.port, help="port to listen on")
    add_flag(parser, "model", default=d.model, help="model folder (tokenizer and chat template)")
    add_flag(parser, "routers", type=list, default=list(d.routers),
             help="comma-separated router addresses, one per model replica")
    add_flag(parser, "default-max-tokens", type=int, default=d.default_max_tokens,
             help="max_tokens when a request leaves it unset (capped by the context)")
    add_flag(parser, "affinity-tokens", type=int, default=d.affinity_tokens,
             help="leading prompt tokens hashed to pick a router")
    add_flag(parser, "probe-interval-s", type=float, default=d.probe_interval_s,
             help="seconds between GetServerInfo probes of the routers")
    add_flag(parser, "probe-timeout-s", type=float, default=d.probe_timeout_s,
             help="timeout of one router probe")
    add_flag(parser, "shutdown-grace-s", type=float, default=d.shutdown_grace_s,
             help="seconds open streams get to finish on shutdown")
    add_flag(parser, "log-level", default=d.log_level, help="logging level")
    add_flag(parser, "http-port", type=int, default=d.http_port,
             help="port of the OpenAI-compatible HTTP API (0: off)")
    add_flag(parser, "max-choices", type=int, default=d.max_choices,
             help="choices one HTTP request may ask for (n x prompts)")
    add_flag(parser, "metrics-port", type=int, default=d.metrics_port,
             help="port of the Prometheus /metrics endpoint (0: off)")
    add_flag(parser, "constraint-timeout-s", type=float, default=d.constraint_timeout_s,
             help="a constraint that takes longer to compile is rejected as invalid")
    add_flag(parser, "constraint-cache-size", type=int, default=d.constraint_cache_size,
             help="distinct constraints kept compiled (least recently used go first)")
    add_flag(parser, "constraint-threads", type=int, default=d.constraint_threads,
             help="threads that compile constraints, off the event loop")
    add_flag(parser, "tokenizer-threads", type=int, default=d.tokenizer_threads,
             help="threads for tokenization and detokenization (each pool), off the event loop")
    limits = d.limits
    add_flag(parser, "max-request-bytes", type=int, default=limits.max_request_bytes,
             help="largest request message accepted (gRPC's receive limit; larger ones get "
             "RESOURCE_EXHAUSTED before they are read)")
    add_flag(parser, "max-prompt-chars", type=int, default=limits.max_prompt_chars,
             help="characters of a prompt, or of all messages together (Generate and Tokenize)")
    add_flag(parser, "max-prompt-tokens", type=int, default=limits.max_prompt_tokens,
             help="prompt tokens after the chat template (0: the model's context length)")
    add_flag(parser, "max-messages", type=int, default=limits.max_messages,
             help="messages in one chat request")
    add_flag(parser, "max-request-id-len", type=int, default=limits.max_request_id_len,
             help="characters of a caller's request_id")
    add_security_flags(parser, public=True)
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> GatewayConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.routers:
        parser.error("--routers needs at least one address")
    if args.default_max_tokens < 1:
        parser.error("--default-max-tokens must be >= 1")
    if args.affinity_tokens < 0:
        parser.error("--affinity-tokens must be >= 0")
    if args.max_choices < 1:
        parser.error("--max-choices must be >= 1")
    for flag, port in (("--http-port", args.http_port), ("--metrics-port", args.metrics_port)):
        if not 0 <= port < 65536:
            parser.error(f"{flag} must be in [0, 65535] (0: off), got {port}")
    if args.constraint_timeout_s <= 0:
        parser.error("--constraint-timeout-s must be > 0")
    if args.constraint_cache_size < 1 or args.constraint_threads < 1:
        parser.error("--constraint-cache-size and --constraint-threads must be >= 1")
    if args.tokenizer_threads < 1:
        parser.error("--tokenizer-threads must be >= 1")
    try:
        # Each limit's flag is named after its field.
        names = RequestLimits.__dataclass_fields__
        limits = RequestLimits(**{name: getattr(args, name) for name in names})
        security = security_from_args(args)
    except (ValueError, SecurityError) as exc:
        parser.error(str(exc))
    return GatewayConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        routers=tuple(args.routers),
        default_max_tokens=args.default_max_tokens,
        affinity_tokens=args.affinity_tokens,
        probe_interval_s=args.probe_interval_s,
        probe_timeout_s=args.probe_timeout_s,
        shutdown_grace_s=args.shutdown_grace_s,
        log_level=args.log_level,
        http_port=args.http_port,
        max_choices=args.max_choices,
        metrics_port=args.metrics_port,
        constraint_timeout_s=args.constraint_timeout_s,
        constraint_cache_size=args.constraint_cache_size,
        constraint_threads=args.constraint_threads,
        tokenizer_threads=args.tokenizer_threads,
        limits=limits,
        security=security,
    )
