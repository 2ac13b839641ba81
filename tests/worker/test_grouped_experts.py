"""The compiled grouped-expert product (`csrc/moe_experts.cpp` through
`backends/grouped_experts.py`) equals the layer's PyTorch grouped product (`SparseMoE.per_expert`)
on the same weights, and a backend offering it is what a MoE model takes on `auto`."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from worker.families import make_family
from worker_service.backends.grouped_experts import CompiledExperts, ExpertProducts
from worker_service.backends.selection import select_backend
from worker_service.backends.torch_backend import TorchBackend
from worker_service.distributed import TPGroup
from worker_service.model_runner import ModelRunner, RunnerConfig
from worker_service.models.moe import ExpertLayout, Routing, SparseMoE
from worker_service.native import library, moe_kernels

CPU = torch.device("cpu")
LAYOUT = ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj")

KERNELS = moe_kernels.load()
needs_kernel = pytest.mark.skipif(KERNELS is None, reason=f"the grouped-expert kernel: {moe_kernels.failure()}")


def test_the_kernel_builds_wherever_avx2_and_fma_and_a_compiler_are() -> None:
    flags = library.cpu_flags().split()
    if shutil.which(os.environ.get("CXX") or "g++") is None or not {"avx2", "fma"} <= set(flags):
        pytest.skip("no C++ compiler or no AVX2/FMA here")
    assert KERNELS is not None, moe_kernels.failure()  # a source that stopped compiling fails here


def test_a_cpu_without_avx2_is_refused_without_asking_the_compiler(monkeypatch) -> None:
    def no_compiler(*args, **kwargs):
        raise AssertionError("the compiler was asked although the CPU has no AVX2")

    monkeypatch.setattr(library, "cpu_flags", lambda: "flags\t\t: fpu sse2 avx")
    monkeypatch.setattr(library, "build", no_compiler)
    fresh = library.LazyLibrary("radixserve-moe", moe_kernels.SOURCES, moe_kernels.COMPILE_FLAGS,
                                moe_kernels.REQUIRED_CPU_FLAGS, moe_kernels.MoEKernels)
    assert fresh.load() is None
    assert fresh.failure() == "this CPU lacks avx2, fma"


def random_block(hidden: int, inter: int, num_experts: int, top_k: int, dtype: torch.dtype,
                 group: TPGroup = TPGroup()) -> SparseMoE:
    """A SparseMoE of random weights, packed by a backend offering the compiled product."""
    block = SparseMoE(0, hidden, inter, Routing(num_experts, top_k, normalize=True), LAYOUT, group, dtype, CPU,
                      TorchBackend(CPU, dtype))
    generator = torch.Generator().manual_seed(hidden * 1000 + inter)
    for param in block.parameters():
        param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    block.pack(TorchBackend(CPU, dtype, experts=ExpertProducts(KERNELS)))
    assert isinstance(block.experts, CompiledExperts)
    return block


def routed(rows: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random routing of `rows` rows that leaves expert 0 without rows (weights, ids)."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(rows, num_experts, generator=generator)
    scores[:, 0] = -1.0
    weights, ids = scores.topk(top_k, dim=-1)
    return weights.softmax(dim=-1), ids


@pytest.fixture
def one_thread():
    """Tiny products on one thread: a second one only waits on a shared machine's other load."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("top_k", [1, 2])
def test_compiled_product_equals_the_per_expert_products(top_k, one_thread) -> None:
    # Odd sizes: neither hidden nor the intermediate size a multiple of the kernel's 8 lanes or
    # its 16-feature chunks; 7 experts, expert 0 never routed to, rows 1 .. 64.
    block = random_block(hidden=37, inter=19, num_experts=7, top_k=top_k, dtype=torch.float32)
    generator = torch.Generator().manual_seed(top_k)
    with torch.inference_mode():
        for rows in range(1, 65):
            hidden = torch.randn(rows, 37, generator=generator)
            weights, ids = routed(rows, 7, top_k, rows)
            expected = block.per_expert(hidden, ids, weights)
            torch.testing.assert_close(block.experts(hidden, ids, weights), expected, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, rows=rows: f"{rows} rows: {m}")


@needs_kernel
@pytest.mark.parametrize("rows", [9, 37])  # up to 5 rows an expert, and passes of 8, 8 and the rest
def test_bfloat16_weights_match_the_float32_product_of_the_same_weights(rows) -> None:
    block = random_block(hidden=64, inter=40, num_experts=4, top_k=2, dtype=torch.bfloat16)
    hidden = torch.randn(rows, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    weights, ids = routed(rows, 4, 2, 0)
    experts = block.experts
    reference = CompiledExperts(KERNELS, list(experts.gate_up.float()), list(experts.down.float()), 64)
    with torch.inference_mode():
        expected = reference(hidden.float(), ids, weights)
        # The float32 product over the bfloat16 weights, rounded once to bfloat16 at the end.
        torch.testing.assert_close(experts(hidden, ids, weights).float(), expected, atol=1e-2, rtol=1e-2)
        assert experts(hidden, ids, weights).dtype == torch.bfloat16


@needs_kernel
def test_steps_past_max_rows_are_left_to_the_per_expert_products() -> None:
    block = random_block(hidden=16, inter=8, num_experts=4, top_k=2, dtype=torch.float32)
    hidden = torch.randn(block.experts.max_rows + 1, 16)
    weights, ids = routed(hidden.shape[0], 4, 2, 0)
    assert block.experts(hidden, ids, weights) is None
    # The per-expert layers multiply views of the stacked experts: the weights are held once.
    assert block.gate_up[1].weight.untyped_storage().data_ptr() == block.experts.gate_up.untyped_storage().data_ptr()


class Passes:
    """A kernel that only says how many rows share a pass (the rule needs nothing else)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def rows_per_pass(self, dtype: torch.dtype) -> int:
        return self.rows


@pytest.mark.parametrize(("rows_per_pass", "large_limit"), [(4, 8), (8, 8)])
def test_rows_per_expert_past_the_passes_that_pay_are_left_to_the_per_expert_products(rows_per_pass,
                                                                                      large_limit) -> None:
    """An expert of 8.65M weights (DeepSeek-V2-Lite's 2,048 x 1,408 x 3) pays for two passes of
    4 rows (AVX2) or one of 8 (AVX-512 BF16): 8 rows an expert either way; one of 24,576
    weights, for every step up to the row limit. Decided without the kernel (never called here)."""
    def experts(hidden: int, inter: int, num_experts: int) -> CompiledExperts:
        gate_up = [torch.empty(2 * inter, hidden, dtype=torch.bfloat16)] * num_experts
        down = [torch.empty(hidden, inter, dtype=torch.bfloat16)] * num_experts
        return CompiledExperts(Passes(rows_per_pass), gate_up, down, 128)

    large = experts(2048, 1408, 4)
    assert large.max_rows_per_expert == large_limit
    assert large.takes(1, 6) and large.takes(5, 6)  # 30 pairs over 4 experts: under 8 each
    assert not large.takes(6, 6)  # 36 pairs
    small = experts(64, 128, 16)
    assert small.takes(128, 2) and not small.takes(129, 2)  # the row limit alone


def test_the_kernel_says_how_many_rows_share_a_pass() -> None:
    """4 for float32 weights; for bfloat16 8 where the CPU has AVX-512 BF16 (built for it), else 4."""
    if KERNELS is None:
        pytest.skip(f"the grouped-expert kernel: {moe_kernels.failure()}")
    pairs = "avx512_bf16" in library.cpu_flags().split()
    assert KERNELS.rows_per_pass(torch.float32) == 4
    assert KERNELS.rows_per_pass(torch.bfloat16) == (8 if pairs else 4)


@needs_kernel
def test_each_rank_multiplies_its_intermediate_slice() -> None:
    ranks = [random_block(hidden=24, inter=21, num_experts=3, top_k=2, dtype=torch.float32,
                          group=TPGroup(rank, 2)) for rank in range(2)]
    assert [block.experts.down.shape[2] for block in ranks] == [11, 10]
    hidden = torch.randn(5, 24)
    weights, ids = routed(5, 3, 2, 1)
    with torch.inference_mode():
        for block in ranks:
            torch.testing.assert_close(block.experts(hidden, ids, weights), block.per_expert(hidden, ids, weights),
                                       atol=1e-5, rtol=1e-5)


@needs_kernel
def test_auto_takes_the_compiled_product_for_a_moe_model(tmp_path) -> None:
    assert "MoE experts by the compiled grouped product" in select_backend("auto", "cpu", torch.float32, 16).reason
    assert "MoE" not in select_backend("torch", "cpu", torch.float32, 16).reason
    runner = ModelRunner(RunnerConfig(model_dir=make_family("qwen3_moe", tmp_path / "moe"), page_size=4,
                                      kv_cache_bytes=1 << 20, attention_kernel="auto"))
    blocks = [module for module in runner.model.modules() if isinstance(module, SparseMoE)]
    assert blocks and all(isinstance(block.experts, CompiledExperts) for block in blocks)


@needs_kernel
@pytest.mark.parametrize("rank", [0, 1])
def test_gpt_oss_experts_biases_and_clamped_swiglu_in_the_compiled_product(rank, one_thread) -> None:
    """GPT-OSS's experts (`ExpertExtras`): gate/up and down biases (the down ones on rank 0
    only) and the clamped SwiGLU, at a limit the products cross, equal to its per-expert
    products (which transformers' class is held to by the family suite)."""
    from types import SimpleNamespace

    from worker_service.models.gpt_oss import GptOssMoE

    config = SimpleNamespace(num_local_experts=6, num_experts_per_tok=2, hidden_size=40, intermediate_size=70,
                             swiglu_limit=0.7, swiglu_alpha=1.702)
    block = GptOssMoE(config, 0, TPGroup(rank, 2), torch.float32, CPU, TorchBackend(CPU, torch.float32))
    generator = torch.Generator().manual_seed(rank)
    for param in block.parameters():
        param.copy_(torch.randn(param.shape, generator=generator) / max(1, param.shape[-1]) ** 0.5)
    block.pack(TorchBackend(CPU, torch.float32, experts=ExpertProducts(KERNELS)))
    assert isinstance(block.experts, CompiledExperts)
    assert (block.down[0].bias is None) == (rank == 1)
    with torch.inference_mode():
        for rows in range(1, 41):
            hidden = torch.randn(rows, 40, generator=generator) * 2
            weights, ids = routed(rows, 6, 2, rows)
            gate_up = block.gate_up[ids[0, 0]](hidden)
            assert gate_up.abs().max() > config.swiglu_limit  # the clamp binds
            torch.testing.assert_close(block.experts(hidden, ids, weights), block.per_expert(hidden, ids, weights),
                                       atol=1e-5, rtol=1e-5, msg=lambda m, rows=rows: f"{rows} rows: {m}")
