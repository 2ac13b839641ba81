"""The tensor-parallel group: process-group setup and the few collectives the model needs.

Every rank of one model replica is in one group. With `world_size == 1` there is no process group
at all and every collective is the identity, so single-rank code never touches torch.distributed.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_INIT_TIMEOUT_S = 300.0
# Without a separate setting, a collective waits for its peers as long as the rendezvous does.
DEFAULT_COLLECTIVE_TIMEOUT_S = DEFAULT_INIT_TIMEOUT_S
# Pending connections the rendezvous socket queues (ranks connect more than once each).
STORE_BACKLOG = 128


@dataclass(slots=True, frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: str,
    timeout_s: float = DEFAULT_INIT_TIMEOUT_S,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
) -> TPGroup:
    """Join the TP group: NCCL when `device` is CUDA, gloo otherwise; nothing when alone.

    Blocks until all `world_size` ranks have joined (or `timeout_s` passes). A collective that
    waits longer than `collective_timeout_s` for a peer raises: the group is broken then.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    if world_size == 1:
        return TPGroup(0, 1)
    return join_group(rank, world_size, master_addr, master_port, device, timeout_s, collective_timeout_s)


def join_group(
    rank: int, world_size: int, master_addr: str, master_port: int, device: str,
    timeout_s: float, collective_timeout_s: float,
) -> TPGroup:
    """Join the process group (NCCL on CUDA, gloo otherwise) through our own store; a group of
    one joins too (what a single GPU can check of the NCCL path)."""
    is_cuda = torch.device(device).type == "cuda"
    if is_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        # Our own store (listening on master_addr only), so that the rendezvous and the
        # collectives get their own deadlines.
        store = rendezvous_store(
            rank, world_size, master_addr, master_port, timedelta(seconds=timeout_s)
        )
        dist.init_process_group(
            backend="nccl" if is_cuda else "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
    return TPGroup(rank, world_size)


def rendezvous_store(
    rank: int, world_size: int, master_addr: str, master_port: int, timeout: timedelta
) -> dist.TCPStore:
    """The group's key-value store; rank 0 serves it on `master_addr` only.

    torch's `tcp://` init (and `TCPStore(is_master=True)`) listens on every interface. Instead
    rank 0 binds the socket itself, to the address `master_addr` resolves to (the pod's or
    container's own), and hands it to the store as `master_listen_fd`, which the libuv store
    (torch's default) accepts. `master_addr` must therefore name an address of rank 0's own host.
    """
    if rank != 0:
        return dist.TCPStore(master_addr, master_port, world_size, False, timeout)
    family, kind, proto, _, address = socket.getaddrinfo(
        master_addr, master_port, type=socket.SOCK_STREAM
    )[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(STORE_BACKLOG)
    except OSError as exc:
        listener.close()
        raise OSError(
            f"rank 0 cannot listen for the rendezvous on {master_addr}:{master_port} "
            f"({exc.strerror}); MASTER_ADDR must be an address of rank 0's own host"
        ) from exc
    # The store owns the socket from here on (it closes it).
    return dist.TCPStore(
        master_addr, master_port, world_size, True, timeout, master_listen_fd=listener.detach()
    )


def all_reduce_sum(tensor: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Sum `tensor` over the group, in place; returns it."""
    if group.world_size > 1:
        dist.all_reduce(tensor)
    return tensor


def gather_last_dim(tensor: torch.Tensor, sizes: list[int], group: TPGroup) -> torch.Tensor | None:
    """Concatenate each rank's `[..., sizes[r]]` shard along the last dim, on rank 0 only.

    Shards may differ in width (an uneven vocabulary split); they are padded to the widest for the
    collective and trimmed after. Returns None on every rank but 0.
    """
    if group.world_size == 1:
        return tensor
    width = max(sizes)
    padded = tensor
    if tensor.shape[-1] < width:
        padded = torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1]))
    padded = padded.contiguous()
    buffers = [torch.empty_like(padded) for _ in range(group.world_size)] if group.is_first else None
    dist.gather(padded, gather_list=buffers, dst=0)
    if not group.is_first:
        return None
    return torch.cat([buf[..., :size] for buf, size in zip(buffers, sizes)], dim=-1)


def broadcast_ids(ids: list[int], group: TPGroup, device: str) -> list[int]:
    """Rank 0's `ids` on every rank; the others pass a list of the same length (any values)."""
    if group.world_size == 1:
        return ids
    tensor = torch.tensor(ids, dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=0)
    return tensor.tolist()
