"""Does one row's result of a linear layer depend on how many rows are computed with it?

    python -m bench.batch_invariance [--model DIR] [--dtype float32]

For each linear shape of the model (q/k/v, o, gate/up, down, LM head), the same input row is
multiplied alone (one row: a matrix-vector product) and among 2, 8 and 64 rows (a matrix
product), and the largest difference of its outputs is printed. Where it is not zero, a greedy
answer depends on the batch it was computed in: a decode step alone and the same step among
other requests' rows can round differently, and where two tokens nearly tie, pick differently.
That is why a prompt recomputed after a worker-group restart (the router drops its cache: the
old group's K/V is gone) under another load can answer differently from the same prompt
computed alone, though nothing of the old group was reused.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from radixserve.shared_flags import DEFAULT_MODEL_DIR

BATCH_SIZES = (2, 8, 64)


def shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each linear layer of a Llama-style config."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    kv = config.get("num_key_value_heads", heads)
    return {
        "qkv_proj": ((heads + 2 * kv) * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_up_proj": (2 * config["intermediate_size"], hidden),
        "down_proj": (hidden, config["intermediate_size"]),
        "lm_head": (config["vocab_size"], hidden),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_invariance",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = json.loads((Path(args.model) / "config.json").read_text())
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(args.seed)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    for name, (out_features, in_features) in shapes(config).items():
        weight = (torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5).to(dtype)
        rows = torch.randn(max(BATCH_SIZES), in_features, generator=generator).to(dtype)
        alone = torch.nn.functional.linear(rows[:1], weight)
        diffs = [float((torch.nn.functional.linear(rows[:m], weight)[:1] - alone).abs().max())
                 for m in BATCH_SIZES]
        print(f"{name:13} {out_features:6} x {in_features:5}: row 0 alone vs among "
              + ", ".join(f"{m} rows {d:.2e}" for m, d in zip(BATCH_SIZES, diffs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
