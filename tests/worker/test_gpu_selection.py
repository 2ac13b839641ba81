"""What decides the CUDA path, checked where no GPU is: the backend selection for the Triton
setting, the Triton plan's layout, and the CUDA graphs' batch buckets (the kernels themselves:
tests/gpu/)."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from worker.tiny_models import make_tiny_llama
from worker_service.attention.gpu_decode import padded_tables, plan_gpu_decode
from worker_service.backends import select_backend
from worker_service.backends.cuda_graphs import bucket_sizes
from worker_service.model_runner import ModelRunner, RunnerConfig

CPU = torch.device("cpu")


def test_triton_is_never_chosen_off_cuda_and_insisting_on_it_says_why() -> None:
    assert select_backend("auto", CPU, torch.bfloat16, 64).backend.name != "triton"
    assert select_backend("torch", CPU, torch.bfloat16, 64).backend.name == "torch"
    with pytest.raises(RuntimeError, match="--attention-kernel triton: it runs on CUDA only, not cpu"):
        select_backend("triton", CPU, torch.bfloat16, 64)


def test_a_worker_asked_for_triton_on_cpu_refuses_to_start(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="--attention-kernel triton"):
        ModelRunner(RunnerConfig(model_dir=make_tiny_llama(tmp_path / "model"), attention_kernel="triton",
                                 kv_cache_bytes=1 << 20))


def test_the_plan_holds_each_rows_used_pages_and_length() -> None:
    plan = plan_gpu_decode([[5, 9, 2, 6], [7], [3, 1, 8, 4]], [33, 16, 49], 16, CPU)
    assert plan.num_rows == 3 and plan.page_size == 16
    assert plan.block_tables.dtype == torch.int32 and plan.context_lens.dtype == torch.int32
    assert plan.context_lens.tolist() == [33, 16, 49]
    # Pages past a row's length are left out (row 0's fourth), the rest padded with page 0.
    assert plan.block_tables.tolist() == [[5, 9, 2, 0], [7, 0, 0, 0], [3, 1, 8, 4]]


def test_graph_tables_pad_with_the_padding_page_to_the_widest_used_row() -> None:
    """What a graph replay copies into its static page tables (`cuda_graphs.py`)."""
    tables = padded_tables([[4, 8, 1], [2, 6, 3, 9]], [1, 33], 16, fill=99)
    assert tables.dtype == torch.int32 and tables.tolist() == [[4, 99, 99], [2, 6, 3]]


def test_padded_tables_equal_padding_each_row_by_hand() -> None:
    """Rows of every width, on and off page boundaries; the tensor outlives the lists it came from."""
    rng = random.Random(7)
    for _ in range(50):
        lens = [rng.randint(1, 200) for _ in range(rng.randint(1, 40))]
        tables = [rng.sample(range(1000), -(-n // 16) + rng.randint(0, 3)) for n in lens]
        expected_width = max(-(-n // 16) for n in lens)
        expected = [t[:-(-n // 16)] + [7] * (expected_width - -(-n // 16)) for t, n in zip(tables, lens)]
        got = padded_tables(tables, lens, 16, fill=7)
        del tables
        gc.collect()
        assert got.shape == (len(lens), expected_width) and got.tolist() == expected


@pytest.mark.parametrize(("max_batch", "sizes"), [
    (1, [1]), (8, [1, 2, 4, 8]), (16, [1, 2, 4, 8, 16]), (20, [1, 2, 4, 8, 16, 20]),
    (128, [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]),
])
def test_graph_buckets_cover_every_batch_up_to_the_largest(max_batch: int, sizes: list[int]) -> None:
    assert bucket_sizes(max_batch) == sizes
