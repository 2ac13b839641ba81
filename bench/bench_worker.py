"""Speed of one worker's `ModelRunner` with no gRPC around it: decode and prefill tokens/s.

    .venv/bin/python -m bench.bench_worker [--model DIR] [--dtypes float32,bfloat16] [--num-threads 2]

Figures (per dtype):
- decode x1: one sequence with a prompt of --context tokens decodes --steps tokens;
- decode xB: --batch such sequences decode together, one step = B tokens;
- prefill:   one prompt of --prefill-len tokens computed at once (after one warm-up);
- prefill xN: N prompts of --prefill-len / N tokens in one step.
Each figure is the best of --repeats runs (others may be loading the machine; best-of shows what
the code can do). `--profile` prints a torch.profiler table of one batched decode step;
`--transformers` adds transformers' `generate` for one sequence as the reference point.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from worker_service.forward_batch import ForwardEntry  # noqa: E402
from worker_service.model_runner import ModelRunner, RunnerConfig  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "smollm2-135m-instruct"
PREFILL_GROUP = 8  # prompts per setup step


def page_tables(num_sequences: int, tokens_each: int, page_size: int) -> list[list[int]]:
    pages_each = (tokens_each + page_size - 1) // page_size
    return [list(range(i * pages_each, (i + 1) * pages_each)) for i in range(num_sequences)]


def prompt(length: int, seed: int, vocab_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=generator).tolist()


class DecodeBench:
    """`batch` sequences of `context` tokens, prefilled once; each `run` times `steps` decode steps.

    Runs continue the same sequences (the context grows by `steps` per run), so repeating a
    measurement does not pay for the prefill again.
    """

    def __init__(self, runner: ModelRunner, batch: int, context: int, steps: int, runs: int) -> None:
        self.runner, self.batch, self.steps = runner, batch, steps
        vocab, page_size = runner.info.vocab_size, runner.info.page_size
        self.tables = page_tables(batch, context + steps * runs, page_size)
        prompts = [prompt(context, seed, vocab) for seed in range(batch)]
        for first in range(0, batch, PREFILL_GROUP):
            runner.forward([ForwardEntry(prompts[i], 0, self.tables[i], False)
                            for i in range(first, min(batch, first + PREFILL_GROUP))])
        self.position = context
        self.next_ids = [ids[-1] for ids in prompts]

    def run(self) -> float:
        """Tokens per second over `steps` steps of the whole batch."""
        start = time.perf_counter()
        for _ in range(self.steps):
            entries = [ForwardEntry([self.next_ids[i]], self.position, self.tables[i], True)
                       for i in range(self.batch)]
            self.next_ids = self.runner.forward(entries).argmax(-1).tolist()
            self.position += 1
        return self.batch * self.steps / (time.perf_counter() - start)


def prefill_tokens_per_s(runner: ModelRunner, length: int, num_prompts: int) -> float:
    each = length // num_prompts
    tables = page_tables(num_prompts, each, runner.info.page_size)
    entries = [ForwardEntry(prompt(each, 100 + i, runner.info.vocab_size), 0, tables[i], True)
               for i in range(num_prompts)]
    start = time.perf_counter()
    runner.forward(entries)
    return num_prompts * each / (time.perf_counter() - start)


def transformers_decode_tokens_per_s(model_dir: Path, dtype: str, context: int, steps: int) -> float:
    """The reference point: transformers' own greedy `generate` for one sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt(context, 0, model.config.vocab_size)])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=0)
    return steps / (time.perf_counter() - start)


def profile_decode(runner: ModelRunner, batch: int, context: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    tables = page_tables(batch, context + 1, runner.info.page_size)
    entries = [ForwardEntry([5], context, table, True) for table in tables]
    runner.forward(entries)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.forward(entries)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=128, help="prompt tokens before decoding")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prefill-prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--transformers", action="store_true", help="also time transformers' generate (x1)")
    args = parser.parse_args()

    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    print(f"model {args.model.name}, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f} at start")
    header = ("dtype", "decode x1 tok/s", f"decode x{args.batch} tok/s", f"prefill {args.prefill_len} tok/s",
              f"prefill {args.prefill_prompts}x{args.prefill_len // args.prefill_prompts} tok/s")
    print(" | ".join(f"{h:>20}" for h in header), flush=True)
    for dtype in args.dtypes.split(","):
        runner = ModelRunner(RunnerConfig(model_dir=args.model, dtype=dtype,
                                          kv_cache_bytes=args.kv_cache_mb << 20))
        prefill_tokens_per_s(runner, args.prefill_len, 1)  # warm-up: first calls pick kernels
        # Best of --repeats: others may be loading the machine; the best shows what the code can do.
        single = DecodeBench(runner, 1, args.context, args.steps, args.repeats)
        batched = DecodeBench(runner, args.batch, args.context, args.steps, args.repeats)
        figures = [
            max(single.run() for _ in range(args.repeats)),
            max(batched.run() for _ in range(args.repeats)),
            max(prefill_tokens_per_s(runner, args.prefill_len, 1) for _ in range(args.repeats)),
            max(prefill_tokens_per_s(runner, args.prefill_len, args.prefill_prompts) for _ in range(args.repeats)),
        ]
        print(" | ".join([f"{dtype:>20}"] + [f"{f:>20.1f}" for f in figures]), flush=True)
        if args.transformers:
            reference = transformers_decode_tokens_per_s(args.model, dtype, args.context, args.steps)
            print(f"{'transformers ' + dtype:>20} | {reference:>20.1f}", flush=True)
        if args.profile:
            profile_decode(runner, args.batch, args.context)
        del runner
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
