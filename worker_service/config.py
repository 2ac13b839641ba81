"""The worker's configuration: one frozen value, each field a setting declared once (flag and
`RADIXSERVE_*` variable, see `radixserve.flags`).

Rank, world size and the rendezvous address fall back to the standard `RANK`, `WORLD_SIZE`,
`MASTER_ADDR` and `MASTER_PORT` variables (what torchrun, LeaderWorkerSet and compose set), so a
deployment can use either spelling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve import flags
from radixserve.flags import MAX_PORT, setting
from radixserve.security import SecurityConfig, security_settings
from radixserve.shared_flags import (ACTIVATION_QUANTIZATION, CONSTRAINT_CACHE_SIZE, DETERMINISTIC, DEVICE, DTYPE,
                                     HOST, KV_CACHE_MB,
                                     LOG_FORMAT, LOG_LEVEL,
                                     LM_HEAD_QUANTIZATION, METRICS_PORT, MODEL, PORT, QUANTIZATION)
from worker_service.backends.selection import KERNEL_CHOICES
from worker_service.quant.scheme import GROUP_SIZE_CHOICES


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(slots=True, frozen=True)
class WorkerConfig:
    model: str = MODEL()
    host: str = HOST()
    port: int = PORT(50060)
    device: str = DEVICE(default_device, help="where weights and KV pages live (cuda when available)")
    dtype: str = DTYPE()
    page_size: int = setting(16, "tokens per KV page (must match the router's view)", min=1)
    kv_cache_mb: int = KV_CACHE_MB(help="this rank's KV page pool budget, in MiB (the page count follows)")
    quantization: str = QUANTIZATION()
    lm_head_quantization: str = LM_HEAD_QUANTIZATION()
    activation_quantization: str = ACTIVATION_QUANTIZATION()
    quantization_group_size: int = setting(32, "columns per int4 group (each with its own scale and offset)",
                                           choices=GROUP_SIZE_CHOICES)
    num_threads: int = setting(0, "torch intra-op threads (0: torch's default)", min=0)
    attention_kernel: str = setting("auto", "native: C++ kernels compiled for this CPU on first use (paged attention "
                                    "for decode and prefill, reading K/V through page tables; RoPE with the K/V "
                                    "write, residual add + RMSNorm and SwiGLU in one pass each; linear "
                                    "layers of decode steps (up to 128 rows); needs a C++ "
                                    "compiler and AVX-512); triton: on CUDA, a Triton kernel reading every "
                                    "decode row's K/V through its page table; torch: PyTorch's kernels "
                                    "(gathers pages); auto: native on CPU where it builds, triton on CUDA "
                                    "where triton imports",
                                    choices=KERNEL_CHOICES)
    deterministic: bool = DETERMINISTIC()
    cuda_graph_max_batch: int = setting(128, "on CUDA (with the triton kernel, one rank), decode steps of up to "
                                        "this many rows replay captured CUDA graphs; 0: never", min=0)
    rank: int = setting(0, "this rank", min=0, also_env="RANK")
    world_size: int = setting(1, "tensor-parallel size", min=1, also_env="WORLD_SIZE")
    master_addr: str = setting("127.0.0.1", "rank 0's address for the TP group's rendezvous", also_env="MASTER_ADDR")
    master_port: int = setting(29500, "rendezvous port", min=0, max=MAX_PORT, also_env="MASTER_PORT")
    rendezvous_timeout_s: float = setting(300.0, "seconds to wait for every rank to join the TP group", above=0)
    collective_timeout_s: float = setting(60.0, "seconds a collective waits for a peer; past it the group is "
                                          "broken and the rank exits with status 3", above=0)
    peer_timeout_s: float = setting(15.0, "seconds without a heartbeat from a peer rank, or an answer from the "
                                    "group store, before this rank leaves its group (exit status 3)", above=0)
    shutdown_grace_s: float = setting(5.0, "seconds in-flight calls get on SIGTERM", min=0)
    log_level: str = LOG_LEVEL()
    log_format: str = LOG_FORMAT()
    metrics_port: int = METRICS_PORT(50160)
    constraint_cache_size: int = CONSTRAINT_CACHE_SIZE(help="distinct constraints rank 0 keeps compiled")
    constraint_threads: int = setting(1, "threads rank 0 fills constraint masks with (1: on the step's own "
                                      "thread)", min=1)
    security: SecurityConfig = security_settings()

    def __post_init__(self) -> None:
        flags.check(self)
        if not self.rank < self.world_size:
            raise ValueError(f"--rank {self.rank} is outside --world-size {self.world_size}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


PROGRAM = flags.Program(
    WorkerConfig, "python -m worker_service",
    "One tensor-parallel worker rank: a weight shard, its KV pages, and the WorkerService gRPC "
    "API that executes the router's DecodeTasks.",
)
parse_config = PROGRAM.parse
