"""The NCCL code path of the TP group: one GPU cannot hold two NCCL ranks, so it joins a group of
one through the same code a TP=2 group on two GPUs uses (TP=2 itself runs over gloo on this
machine's CPU cores: tests/worker/test_tensor_parallel.py and tests/e2e/test_stack_tp2.py)."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from worker_service.distributed import TPGroup, join_group


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_nccl_group_of_one_initialises_and_reduces() -> None:
    join_group(0, 1, "127.0.0.1", free_port(), "cuda", timeout_s=60, collective_timeout_s=60)
    try:
        assert dist.get_backend() == "nccl"
        tensor = torch.arange(6, dtype=torch.float32, device="cuda")
        dist.all_reduce(tensor)
        assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        ids = torch.tensor([4, 5], device="cuda")
        dist.broadcast(ids, src=0)
        assert ids.tolist() == [4, 5]
        gathered = [torch.empty(2, device="cuda")]
        dist.gather(torch.ones(2, device="cuda"), gather_list=gathered, dst=0)
        assert gathered[0].tolist() == [1.0, 1.0]
        assert TPGroup(0, 1).is_first
    finally:
        dist.destroy_process_group()
