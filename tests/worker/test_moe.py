"""The mixture-of-experts layer computes its experts grouped by expert: in one step, each expert
that any token was routed to multiplies once per projection, over exactly the rows routed to it,
and no other expert runs (`worker_service/models/moe.py`)."""

from __future__ import annotations

from collections import Counter

import torch

from worker.families import VOCAB_SIZE, make_family
from worker_service.forward_batch import ForwardEntry
from worker_service.model_runner import ModelRunner, RunnerConfig
from worker_service.models.moe import SparseMoE


def test_each_routed_expert_multiplies_once_over_its_rows(tmp_path) -> None:
    runner = ModelRunner(RunnerConfig(model_dir=make_family("qwen3_moe", tmp_path / "moe"), page_size=4,
                                      kv_cache_bytes=1 << 20, attention_kernel="torch"))
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
    assert len(blocks) == 2  # the middle of the three layers is dense (`mlp_only_layers`)
    routed: dict[int, Counter] = {}  # block -> expert -> (token, choice) pairs routed to it
    calls: dict[int, list[tuple[int, int, int]]] = {}  # block -> (expert, gate/up rows, down rows) per call

    def on_block(index: int):
        def hook(block: SparseMoE, inputs: tuple[torch.Tensor]) -> None:
            routed[index] = Counter(block.route(inputs[0])[1].flatten().tolist())
        return hook

    def on_projection(index: int, expert: int, which: int):
        def hook(_module, inputs: tuple[torch.Tensor]) -> None:
            calls.setdefault(index, []).append((expert, which, inputs[0].shape[0]))
        return hook

    for index, block in enumerate(blocks):
        block.register_forward_pre_hook(on_block(index))
        for expert in range(block.routing.num_experts):
            block.gate_up[expert].register_forward_pre_hook(on_projection(index, expert, 0))
            block.down[expert].register_forward_pre_hook(on_projection(index, expert, 1))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist() for n in (9, 14)]
    runner.forward([ForwardEntry(prompts[0], 0, list(range(4)), True),
                    ForwardEntry(prompts[1], 0, list(range(4, 8)), True)])
    for index, block in enumerate(blocks):
        pairs = routed[index]
        assert sum(pairs.values()) == 23 * block.routing.top_k
        assert 2 < len(pairs) <= block.routing.num_experts  # several experts, each with its rows
        # One gate/up and one down product per routed expert, each over all of its rows.
        expected = sorted((expert, which, count) for expert, count in pairs.items() for which in (0, 1))
        assert sorted(calls[index]) == expected
