"""The worker's configuration: one frozen value built once from flags and `RADIXSERVE_*` variables.

Rank, world size and the rendezvous address default from the standard `RANK`, `WORLD_SIZE`,
`MASTER_ADDR` and `MASTER_PORT` variables (what torchrun, LeaderWorkerSet and compose set), so a
deployment can use either spelling.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from radixserve.flags import add_flag
from radixserve.security import (
    SecurityConfig,
    SecurityError,
    add_security_flags,
    security_from_args,
)
from worker_service.dtypes import AUTO, DTYPE_CHOICES

DEFAULT_MODEL_DIR = "models/smollm2-135m-instruct"
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


@dataclass(slots=True, frozen=True)
class WorkerConfig:
    model: str
    host: str
    port: int
    device: str
    dtype: str
    page_size: int
    kv_cache_mb: int
    num_threads: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    rendezvous_timeout_s: float
    collective_timeout_s: float
    peer_timeout_s: float
    shutdown_grace_s: float
    log_level: str
    metrics_port: int = 50160
    constraint_cache_size: int = 256
    constraint_threads: int = 1
    security: SecurityConfig = SecurityConfig()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    environ = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog="python -m worker_service",
        description="One tensor-parallel worker rank: a weight shard, its KV pages, and the "
        "WorkerService gRPC API that executes the router's DecodeTasks.",
    )

    def flag(name: str, **kwargs) -> None:
        add_flag(parser, name, env=environ, **kwargs)

    flag("model", default=DEFAULT_MODEL_DIR, help="Hugging Face model folder (config.json + safetensors)")
    flag("host", default="127.0.0.1", help="address to listen on")
    flag("port", type=int, default=50060, help="port to listen on")
    flag("device", default=default_device(), choices=["cpu", "cuda"], help="where weights and KV pages live")
    flag("dtype", default=AUTO, choices=DTYPE_CHOICES,
         help="weight and KV dtype; auto: bfloat16 on CUDA or a CPU with AVX512-BF16/AMX, else float32")
    flag("page-size", type=int, default=16, help="tokens per KV page (must match the router's view)")
    flag("kv-cache-mb", type=int, default=1024, help="KV page pool memory budget of this rank, in MiB")
    flag("num-threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    flag("rank", type=int, default=int(environ.get("RANK", "0")), help="this rank (else $RANK, else 0)")
    flag(
        "world-size", type=int, default=int(environ.get("WORLD_SIZE", "1")),
        help="tensor-parallel size (else $WORLD_SIZE, else 1)",
    )
    flag(
        "master-addr", default=environ.get("MASTER_ADDR", "127.0.0.1"),
        help="rank 0's address for the process-group rendezvous (else $MASTER_ADDR)",
    )
    flag(
        "master-port", type=int, default=int(environ.get("MASTER_PORT", "29500")),
        help="rendezvous port (else $MASTER_PORT)",
    )
    flag(
        "rendezvous-timeout-s", type=float, default=300.0,
        help="seconds to wait for every rank to join the TP group",
    )
    flag(
        "collective-timeout-s", type=float, default=60.0,
        help="seconds a collective waits for a peer before the group counts as broken",
    )
    flag(
        "peer-timeout-s", type=float, default=15.0,
        help="seconds without a heartbeat from a peer rank (dead or frozen) before this rank "
        "leaves the group, exiting with status 3 for its restart policy",
    )
    flag("shutdown-grace-s", type=float, default=5.0, help="seconds in-flight calls get on SIGTERM")
    flag("constraint-cache-size", type=int, default=256,
         help="distinct constraints rank 0 keeps compiled (least recently used go first)")
    flag("constraint-threads", type=int, default=1,
         help="threads rank 0 fills constraint masks with (1: on the step's own thread)")
    flag("log-level", type=str.upper, default="INFO", choices=LOG_LEVELS, help="logging level")
    flag("metrics-port", type=int, default=50160,
         help="port of the Prometheus /metrics endpoint (0: off; the launcher gives rank r its gRPC port + 100)")
    add_security_flags(parser, env=environ)
    return parser


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> WorkerConfig:
    """Build the config from `argv` (default: sys.argv) over the environment; exits on bad flags."""
    parser = build_parser(env)
    args = parser.parse_args(argv)
    if args.page_size < 1:
        parser.error(f"--page-size must be >= 1, got {args.page_size}")
    if args.kv_cache_mb < 1:
        parser.error(f"--kv-cache-mb must be >= 1, got {args.kv_cache_mb}")
    if not 0 <= args.metrics_port < 65536:
        parser.error(f"--metrics-port must be in [0, 65535] (0: off), got {args.metrics_port}")
    if args.num_threads < 0:
        parser.error(f"--num-threads must be >= 0, got {args.num_threads}")
    for name in ("rendezvous_timeout_s", "collective_timeout_s", "peer_timeout_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.constraint_cache_size < 1:
        parser.error(f"--constraint-cache-size must be >= 1, got {args.constraint_cache_size}")
    if args.constraint_threads < 1:
        parser.error(f"--constraint-threads must be >= 1, got {args.constraint_threads}")
    if not 0 <= args.rank < args.world_size:
        parser.error(f"--rank {args.rank} is outside --world-size {args.world_size}")
    try:
        security = security_from_args(args)
    except SecurityError as exc:
        parser.error(str(exc))
    values = {k: v for k, v in vars(args).items() if k in WorkerConfig.__dataclass_fields__}
    return WorkerConfig(**values, security=security)
