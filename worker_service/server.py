"""A running worker rank (started and stopped by `radixserve.serving.run_service`).

Start-up order matters for orchestration: the gRPC server comes up first and reports NOT_SERVING
(so probes see a live process), then the rank joins the TP group and loads its weight shard on a
thread, and only then does health flip to SERVING. A rank that fails to load exits 1. Stopping
gives in-flight calls a grace period; a rank in a TP group then leaves at once (`os._exit`),
since its task thread may sit in a collective whose peer is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from collections.abc import Callable
from typing import NoReturn

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from radixserve.heap import freeze_startup_heap
from radixserve.metrics import serve_metrics
from radixserve.model_source import ModelUnreadable
from radixserve.security import load_security
from radixserve.serving import start_server
from radixserve.v1 import worker_pb2_grpc
from worker_service.allocator import keep_freed_memory
from worker_service.config import WorkerConfig
from worker_service.distributed import init_distributed
from worker_service.executor import Executor
from worker_service.grammar import ConstraintMasks
from worker_service.metrics import WorkerMetrics
from worker_service.model_runner import ModelRunner, RunnerConfig
from worker_service.peer_watch import PeerWatch, leave_group
from worker_service.service import SERVICE_NAME, WorkerService
from worker_service.unsupported import UnsupportedModel

log = logging.getLogger(__name__)

BYTES_PER_MIB = 1 << 20


def load_executor(
    config: WorkerConfig, metrics_registry: CollectorRegistry | None = None,
    on_group_formed: Callable[[], None] | None = None,
) -> Executor:
    """Join the TP group and load this rank's shard; blocks (rendezvous, disk reads).
    `on_group_formed` runs once every rank has joined, before the loading."""
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    init_distributed(
        config.rank, config.world_size, config.master_addr, config.master_port, config.device,
        timeout_s=config.rendezvous_timeout_s, collective_timeout_s=config.collective_timeout_s,
    )
    if on_group_formed is not None:
        on_group_formed()
    runner = ModelRunner(
        RunnerConfig(
            model_dir=Path(config.model),
            device=config.device,
            dtype=config.dtype,
            page_size=config.page_size,
            kv_cache_bytes=config.kv_cache_mb * BYTES_PER_MIB,
            rank=config.rank,
            world_size=config.world_size,
            attention_kernel=config.attention_kernel,
            cuda_graph_max_batch=config.cuda_graph_max_batch,
            quantization=config.quantization,
            quantization_group_size=config.quantization_group_size,
            lm_head_quantization=config.lm_head_quantization,
            activation_quantization=config.activation_quantization,
            deterministic=config.deterministic,
        )
    )
    num_pages = group_num_pages(runner.info.num_pages, config)
    log.info(
        "rank %d loaded %.1f MiB of weights; KV pool holds %d pages, the group %d; backend: %s (%s)",
        config.rank, runner.weight_bytes() / BYTES_PER_MIB, runner.info.num_pages, num_pages,
        runner.backend.name, runner.backend_reason,
    )
    metrics = WorkerMetrics(runner.info.model_name, config.rank, metrics_registry)
    metrics.backend_chosen(runner.backend.name)
    metrics.quantization_served(runner.info.quantization)
    constraints = None
    if config.rank == 0:  # only rank 0 samples
        constraints = ConstraintMasks.load(
            Path(config.model), runner.info.vocab_size, list(runner.info.eos_token_ids),
            config.constraint_cache_size, config.constraint_threads,
        )
    sampler = runner.backend.new_sampler() if config.rank == 0 else None
    return Executor(runner, sampler, num_pages=num_pages, metrics=metrics, constraints=constraints)


def group_num_pages(own: int, config: WorkerConfig) -> int:
    """The smallest page count over the TP group, so that every rank accepts the same page ids."""
    if config.world_size == 1:
        return own
    count = torch.tensor([own], dtype=torch.int64, device=config.device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return int(count.item())


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.crashed = asyncio.Event()
        # In a TP group, a task that failed (a collective that broke or timed out) leaves the
        # ranks out of step for good: leave the group for the restart policy to re-form it.
        self.service = WorkerService(on_broken=leave_group if config.world_size > 1 else None)
        self.registry = CollectorRegistry()
        self.port = 0
        self._watch: PeerWatch | None = None

    @classmethod
    async def start(cls, config: WorkerConfig) -> "Worker":
        """Serve at once (NOT_SERVING); join the group and load in the background."""
        keep_freed_memory()  # before the model loads: see allocator.py
        worker = cls(config)
        worker._server, worker._health, worker.port = await start_server(
            config.host, config.port,
            [lambda server: worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker.service, server)],
            [SERVICE_NAME],
            security=load_security(config.security),
        )
        log.info("rank %d/%d listening on %s:%d, loading %s", config.rank, config.world_size,
                 config.host, worker.port, config.model)
        worker._metrics = serve_metrics(worker.registry, config.host, config.metrics_port,
                                        f"rank {config.rank}")
        # On the task thread (see `WorkerService.run_on_task_thread`); off the event loop, so a
        # stop signal during a long rendezvous can still exit (see `stop`).
        worker._loading = asyncio.ensure_future(
            worker.service.run_on_task_thread(load_executor, config, worker.registry,
                                              worker._watch_peers))
        worker._ready = asyncio.create_task(worker._serve_when_loaded())
        return worker

    def _watch_peers(self) -> None:
        """Start the heartbeats as soon as the group has formed (on the loading thread): the
        ranks' rendezvous starts them together, whereas the ends of their loading differ by
        what only rank 0 loads (a peer that waited for it would count it as silent), and a
        peer lost while loading is noticed too."""
        config = self.config
        if config.world_size > 1:
            self._watch = PeerWatch(config.master_addr, config.master_port, config.rank,
                                    config.world_size, config.peer_timeout_s)
            self._watch.start()

    async def _serve_when_loaded(self) -> None:
        config = self.config
        try:
            executor = await self._loading
        except asyncio.CancelledError:
            raise
        # The checkpoint, not the code: its reason is the whole story.
        except (UnsupportedModel, ModelUnreadable) as exc:
            log.error("rank %d cannot serve %s: %s", config.rank, config.model, exc)
            self.crashed.set()
            return
        except BaseException as exc:  # from the loading thread
            log.error("rank %d failed to start", config.rank, exc_info=exc)
            self.crashed.set()
            return
        self.service.attach(executor)
        freeze_startup_heap(f"rank {config.rank}")
        await self._health.set(True)
        info = executor.info
        log.info(
            "worker ready: rank %d/%d serving %s on %s:%d (device %s, dtype %s, %d pages of %d "
            "tokens, context %d)", info.rank, info.world_size, info.model_name, config.host,
            self.port, info.device, info.dtype, info.num_pages, info.page_size, info.context_len,
        )

    async def stop(self) -> None:
        config = self.config
        if not self._loading.done():
            # The loading thread may sit in the rendezvous (C++) and cannot be joined: skip the
            # interpreter's teardown, which would abort on it ("terminate called...", status 134).
            _exit_now(0, "rank %d stopped while loading", config.rank)
        await self._ready
        if self._watch is not None:
            self._watch.stop()  # peers stopping too are not a lost group
        await self._health.set(False)
        await self._server.stop(config.shutdown_grace_s)
        if config.world_size > 1:
            # The task thread may sit in a collective whose peer is gone (it stops too, or was
            # lost): neither joining it nor tearing the group down would return. Leave at once.
            _exit_now(1 if self.crashed.is_set() else 0, "rank %d stopped", config.rank)
        self.service.close()
        if self._metrics is not None:
            self._metrics.stop()
        log.info("rank %d stopped", config.rank)


def _exit_now(status: int, message: str, *args: object) -> NoReturn:
    """Log, flush the logs and leave without the interpreter's teardown."""
    log.info(message, *args)
    logging.shutdown()
    os._exit(status)
