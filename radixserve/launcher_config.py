"""`radixserve up`'s configuration: one frozen value, each field a setting declared once (flag
and `RADIXSERVE_*` variable, see `radixserve.flags`); the settings it shares with the services
are the services' own declarations (`radixserve.shared_flags`), and it passes them down."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gateway_service.config import GatewayConfig
from radixserve import flags
from radixserve.flags import Flag, setting
from radixserve.security import SecurityConfig, security_settings
from radixserve.shared_flags import (ACTIVATION_QUANTIZATION, DETERMINISTIC, DEVICE, DTYPE, HTTP_PORT, KV_CACHE_MB,
                                     LM_HEAD_QUANTIZATION,
                                     LOG_LEVEL, METRICS_PORT, MODEL, PORT, QUANTIZATION)
from router_service.config import RouterConfig

# The services whose own settings `radixserve up` takes and passes down, by child name.
PASSED_TO = {"router": RouterConfig, "gateway": GatewayConfig}
# Their settings the launcher decides itself (addresses, the group's wiring); security and the
# launcher's own settings of the same name are passed down from the launcher's.
_DECIDED = frozenset({"workers", "routers"})
MAX_GATEWAYS = 8
# `--gateways` unset with CUDA workers: one gateway per this many of the host's cores, at most
# MAX_CUDA_GATEWAYS. A gateway process runs one event loop, and on a GPU host's core it streams
# about a third of what a small model's GPU group makes at batch 128 to HTTP or per-request gRPC
# callers (docs/deployment.md, "Sizing the gateways"); the other cores stay the router's and the
# ranks'.
CORES_PER_CUDA_GATEWAY = 4
MAX_CUDA_GATEWAYS = 3


@dataclass(frozen=True, slots=True)
class PassedValue:
    """One router or gateway setting given to `radixserve up`, as its child's flag."""

    flag: str  # without dashes
    value: object
    children: tuple[str, ...]  # the child names that declare it

    def args(self) -> list[str]:
        if isinstance(self.value, bool):
            return [f"--{'' if self.value else 'no-'}{self.flag}"]
        return [f"--{self.flag}", flags.show(self.value)]


@dataclass(frozen=True, slots=True)
class UpConfig:
    model: str = MODEL()
    tp: int = setting(1, "tensor-parallel size: one worker process per rank", min=1)
    port: int = PORT(50051, help="gateway port; the router gets P+1, worker rank r gets P+9+r (replica k: "
                     "router P+1+k, rank r P+9+k*tp+r)")
    replicas: int = setting(1, "model replicas: each a router with its own group of --tp worker ranks; the "
                            "gateway routes over them all", min=1, max=8)
    host: str = setting("127.0.0.1", "address the gateway listens on")
    gateways: int | None = setting(None, "gateway processes, sharing the gateway's gRPC and HTTP ports "
                                   "(SO_REUSEPORT: the kernel spreads new connections over them); gateway i > 0 "
                                   "serves /metrics after every rank's, on M+9+replicas*tp+i-1; unset: 1 where "
                                   "the workers run on the CPU, on CUDA one per 4 of the host's cores, 1 to "
                                   f"{MAX_CUDA_GATEWAYS}", min=1, max=MAX_GATEWAYS)
    http_port: int = HTTP_PORT(help="the gateway's OpenAI-compatible HTTP API port (0: off)")
    metrics_port: int = METRICS_PORT(50151, help="Prometheus /metrics of the gateway M; router M+1, worker "
                                     "rank r M+9+r (0: all off)")
    device: str | None = DEVICE(help="worker device (unset: the worker's default, cuda if available)")
    dtype: str = DTYPE()
    quantization: str = QUANTIZATION()
    lm_head_quantization: str = LM_HEAD_QUANTIZATION()
    activation_quantization: str = ACTIVATION_QUANTIZATION()
    deterministic: bool = DETERMINISTIC()
    kv_cache_mb: int = KV_CACHE_MB()
    startup_timeout_s: float = setting(300.0, "seconds each stage may take to report SERVING", above=0)
    shutdown_timeout_s: float = setting(30.0, "seconds each stage (gateway, router, workers) gets to exit "
                                        "after SIGTERM before SIGKILL", min=0)
    max_worker_restarts: int = setting(3, "restarts in a row of the worker group, or of the router or the "
                                       "gateway, each counted alone (without serving again in between) "
                                       "before the stack stops", min=0)
    log_level: str = LOG_LEVEL(help="log level of every service")
    # Passed down to every service (the API tokens to the gateway only).
    security: SecurityConfig = security_settings(public=True)
    # Router and gateway settings given to `radixserve up` (see `passed_flags`).
    passed: tuple[PassedValue, ...] = ()

    def __post_init__(self) -> None:
        flags.check(self)


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="radixserve launcher")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="serve a model locally: worker rank(s), router, gateway",
                             description="serve a model locally: worker rank(s), router, gateway")
    flags.add_settings(up, UpConfig, env)
    add_passed_flags(up.add_argument_group(
        "router and gateway settings", "passed to the service(s) that declare them; unset: the "
        "service's own default, or its RADIXSERVE_* variable, which the services read themselves"))
    return parser


def config_from_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> UpConfig:
    """`radixserve up ...` (argv starts with `up`) as a config, `--gateways` decided
    (`with_gateways_decided`)."""
    parser = build_parser(env)
    config = flags.parse_into(UpConfig, parser, argv)
    return with_gateways_decided(dataclasses.replace(config, passed=passed_values(parser.parse_args(argv))))


def passed_flags() -> dict[str, tuple[Flag, tuple[str, ...]]]:
    """Every router and gateway setting that `radixserve up` takes, by flag name, with the
    children that declare it: their declarations, not a second list."""
    own = {flag.name for flag in flags.flags_of(UpConfig)}
    found: dict[str, tuple[Flag, tuple[str, ...]]] = {}
    for child, cls in PASSED_TO.items():
        for flag in flags.flags_of(cls):
            if flag.name in own or flag.path[0] in ("security", *_DECIDED):
                continue
            first, children = found.get(flag.name, (flag, ()))
            found[flag.name] = (first, (*children, child))
    return found


def add_passed_flags(group: argparse._ArgumentGroup) -> None:
    for name, (flag, children) in passed_flags().items():
        text = f"{flag.setting.help} ({' and '.join(children)})".replace("%", "%%")
        if flag.is_bool:
            group.add_argument(f"--{name}", dest=_dest(name), action=argparse.BooleanOptionalAction,
                               default=None, help=text)
        else:
            group.add_argument(f"--{name}", dest=_dest(name), type=flag.convert, default=None,
                               help=text)


def passed_values(args: argparse.Namespace) -> tuple[PassedValue, ...]:
    """The router and gateway settings given on the command line."""
    return tuple(PassedValue(name, getattr(args, _dest(name)), children)
                 for name, (_, children) in passed_flags().items()
                 if getattr(args, _dest(name)) is not None)


def _dest(name: str) -> str:
    return "passed_" + name.replace("-", "_")


def default_gateways(on_cuda: bool, num_cores: int) -> int:
    """`--gateways` unset: 1 where the workers run on the CPU (the router, the ranks and the
    gateway already share its cores: a second gateway only competes with them), else one per
    `CORES_PER_CUDA_GATEWAY` cores, 1 to `MAX_CUDA_GATEWAYS`."""
    if not on_cuda:
        return 1
    return max(1, min(MAX_CUDA_GATEWAYS, num_cores // CORES_PER_CUDA_GATEWAY))


def workers_on_cuda(device: str | None) -> bool:
    """Whether the workers will run on CUDA: `--device`, or unset, the workers' own default (CUDA
    where torch sees a GPU). A CPU build of torch (its version ends `+cpu`) is known without
    importing it."""
    if device is not None:
        return device == "cuda"
    try:
        if importlib.metadata.version("torch").endswith("+cpu"):
            return False
    except importlib.metadata.PackageNotFoundError:
        return False
    import torch  # only here: the launcher itself needs no torch

    return torch.cuda.is_available()


def with_gateways_decided(config: UpConfig) -> UpConfig:
    """`config` with `--gateways` set: as given, or `default_gateways` for where the workers run."""
    if config.gateways is not None:
        return config
    return dataclasses.replace(
        config, gateways=default_gateways(workers_on_cuda(config.device), os.cpu_count() or 1))
