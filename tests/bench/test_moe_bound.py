"""An MoE step's bound counts the experts it was routed to: one token reads exactly `top_k`
experts per MoE layer, and the bytes are the model's less every expert it did not read."""

from __future__ import annotations

import torch

from bench import bounds, moe_bound
from worker.families import VOCAB_SIZE, make_family
from worker_service.forward_batch import ForwardEntry
from worker_service.model_runner import ModelRunner, RunnerConfig


def test_one_token_reads_top_k_experts_per_layer_and_multiplies_only_them(tmp_path) -> None:
    runner = ModelRunner(RunnerConfig(model_dir=make_family("qwen3_moe", tmp_path / "moe"), page_size=4,
                                      kv_cache_bytes=1 << 20, attention_kernel="torch"))
    blocks = moe_bound.moe_blocks(runner.model)
    num_experts, top_k = blocks[0].routing.num_experts, blocks[0].routing.top_k
    shape = bounds.step_shape(runner)
    prompt = torch.randint(3, VOCAB_SIZE, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.forward([ForwardEntry(prompt, 0, [0, 1, 2], False)])

    routed = moe_bound.routed_shape(shape, blocks, runner, [ForwardEntry([prompt[-1]], 9, [0, 1, 2], True)])

    assert (routed.num_routed, routed.num_experts) == (top_k * len(blocks), num_experts * len(blocks))
    each = moe_bound.expert_bytes(blocks[0])
    assert each == 3 * 48 * 64 * 4  # gate, up and down of 48 x 64 in float32
    assert routed.shape.weight_bytes == shape.weight_bytes - (num_experts - top_k) * len(blocks) * each
    assert routed.shape.matmul_params == shape.matmul_params - (num_experts - top_k) * len(blocks) * each // 4
    assert routed.shape.kv_bytes_per_position == shape.kv_bytes_per_position
