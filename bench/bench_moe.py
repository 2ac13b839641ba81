"""Decode speed of a mixture-of-experts checkpoint against its bandwidth bound, counting only the
bytes a step actually reads: the weights outside the experts, the experts its tokens were routed
to (distinct experts per layer, counted from the router's choices on the measured steps' inputs)
and the KV of every position of every sequence.

    PYTHONPATH=$PWD .venv/bin/python -m bench.bench_moe [--model DIR] [--batch 1,32] [--dtype float32]

Without --model it saves a random Qwen3-MoE with transformers' own classes in a temporary folder:
hidden 512, 16 experts of 512, top-2, 4 layers, 8 / 2 heads of 64, vocab 8192 (tiny but not
trivial: its experts are most of its bytes, and at batch 32 most experts are routed to). Each
figure is the best of --repeats runs; the read bandwidth is measured in the same run, at its start
and its end, and the larger counts (`bench.bounds`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import bounds as machine  # noqa: E402
from bench.bench_worker import DecodeBench  # noqa: E402
from worker_service.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from worker_service.models.llama import head_dim_of  # noqa: E402
from worker_service.models.moe import SparseMoE  # noqa: E402


def make_random_moe(out_dir: Path) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=8192, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                            num_experts=16, num_experts_per_tok=2, norm_topk_prob=True,
                            max_position_embeddings=4096, tie_word_embeddings=False)
    Qwen3MoeForCausalLM(config).eval().save_pretrained(out_dir)
    return out_dir


def expert_bytes(block: SparseMoE) -> int:
    """Bytes of one expert's three projections (this rank's share)."""
    return sum(layer.weight.numel() * layer.weight.element_size() for layer in (block.gate_up[0], block.down[0]))


class RoutedExperts:
    """Counts the distinct experts each MoE layer is routed to, per forward pass, while installed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
        self.counts: list[int] = []
        self.handles = [b.register_forward_pre_hook(self._count) for b in self.blocks]

    def _count(self, block: SparseMoE, inputs: tuple[torch.Tensor]) -> None:
        self.counts.append(int(block.route(inputs[0])[1].unique().numel()))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="an MoE checkpoint (default: a random one)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=lambda text: [int(b) for b in text.split(",")], default=[1, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attention-kernel", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model or make_random_moe(Path(scratch) / "random-moe")
        run(model_dir, args)


def run(model_dir: Path, args: argparse.Namespace) -> None:
    dtype = getattr(torch, args.dtype)
    first_bandwidth = machine.memory_bandwidth()
    tokens = args.context + args.steps * args.repeats + 1
    pages = sum(args.batch) * (-(-tokens // 16)) + 1
    config_probe = ModelRunner(RunnerConfig(model_dir=model_dir, dtype=args.dtype, kv_cache_bytes=1 << 20,
                                            attention_kernel=args.attention_kernel))
    hf = config_probe.hf_config
    kv_per_position = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim_of(hf) * dtype.itemsize
    del config_probe
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, dtype=args.dtype, page_size=16,
                                      kv_cache_bytes=pages * 16 * kv_per_position,
                                      attention_kernel=args.attention_kernel))
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
    each_expert = expert_bytes(blocks[0])
    other_bytes = runner.weight_bytes() - sum(b.routing.num_experts for b in blocks) * each_expert
    print(f"{model_dir.name}: backend {runner.backend.name}; {len(blocks)} MoE layers of "
          f"{blocks[0].routing.num_experts} experts ({each_expert / 2**20:.2f} MiB each), top-"
          f"{blocks[0].routing.top_k}; {other_bytes / 2**20:.1f} MiB outside the experts", flush=True)
    results = []
    first_page = 0
    for batch in args.batch:
        bench = DecodeBench(runner, batch, args.context, args.steps, args.repeats, first_page=first_page)
        first_page = bench.end_page
        best = max(bench.run() for _ in range(args.repeats))
        counter = RoutedExperts(runner.model)
        bench.steps, position = 1, bench.position
        bench.run()  # one more step, counted (not timed); its tokens are a timed step's kind
        counter.remove()
        experts_read = sum(counter.counts)
        step_bytes = other_bytes + experts_read * each_expert + batch * position * kv_per_position
        results.append((batch, best, experts_read, step_bytes))
    bandwidth = max(first_bandwidth, machine.memory_bandwidth())
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (best of start and end); decode at {args.context}+ positions, "
          f"{args.dtype}:")
    for batch, best, experts_read, step_bytes in results:
        bound = batch * bandwidth / step_bytes
        print(f"  decode x{batch:<3} {best:9.1f} tok/s = {best / bound:4.0%} of its bound {bound:9.1f} "
              f"(a step reads {step_bytes / 2**20:.1f} MiB: {experts_read} of "
              f"{sum(b.routing.num_experts for b in blocks)} layer-experts routed to)")


if __name__ == "__main__":
    main()
