"""One TP rank of `test_tensor_parallel.py`, run as a script: it joins the group, loads only its
shard on the backend it is given, computes the prompt's logits and a greedy continuation (rank 0
picks each token and broadcasts it, as the real rank 0 would return it to the router), and saves
what it saw for the test. Given several models, it does so for each in turn in the same group
(one process start for many checkpoints) and saves a list, one entry per model."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

NUM_NEW_TOKENS = 32


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--rank", "--world-size", "--master-port"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--model", type=Path, nargs="+", required=True)
    parser.add_argument("--prompt", type=str, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend", type=str, required=True)
    parser.add_argument("--quantization", type=str, default="none")
    args = parser.parse_args()

    import torch.distributed as dist

    from worker_service.distributed import init_distributed

    torch.set_num_threads(1)
    init_distributed(args.rank, args.world_size, "127.0.0.1", args.master_port, "cpu")
    results = [run_model(model_dir, args, dist) for model_dir in args.model]
    torch.save(results[0] if len(results) == 1 else results, args.out)
    dist.barrier()  # every rank has saved what it saw
    # Out without tearing the group down, as the worker service's ranks leave: gloo's threads can
    # end a process with std::terminate as it exits ("terminate called without an active
    # exception": rank 0 in 1 of 3 clean-clone runs of the suite, failing the test on its exit
    # status). Nothing of the test's is left to do or to flush but the output streams.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_model(model_dir: Path, args: argparse.Namespace, dist) -> dict:
    from worker.tiny_models import greedy_tokens
    from worker_service.forward_batch import ForwardEntry
    from worker_service.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_bytes=32 << 20,
                                      rank=args.rank, world_size=args.world_size, attention_kernel=args.backend,
                                      quantization=args.quantization))
    assert runner.backend.name == args.backend or args.backend == "auto"  # auto: whatever it chose
    prompt_ids = json.loads(args.prompt)
    page_table = list(range((len(prompt_ids) + NUM_NEW_TOKENS) // runner.info.page_size + 1))
    prompt_logits = runner.forward([ForwardEntry(prompt_ids, 0, page_table, True)])

    step_logits = []  # rank 0's logits of each greedy step: the prompt's last position, then each decode

    class BroadcastGreedy:
        """Rank 0's argmax, shared so that every rank feeds the same next token."""

        def forward(self, entries):
            logits = runner.forward(entries)
            token = torch.zeros(1, dtype=torch.int64)
            if logits is not None:
                step_logits.append(logits[0])
                token[0] = logits[0].argmax()
            dist.broadcast(token, src=0)
            one_hot = torch.zeros(1, runner.info.vocab_size)
            one_hot[0, token[0]] = 1.0
            return one_hot

    tokens = greedy_tokens(BroadcastGreedy(), prompt_ids, NUM_NEW_TOKENS, page_table)
    return {"weight_bytes": runner.weight_bytes(), "prompt_logits": prompt_logits, "tokens": tokens,
            "step_logits": torch.stack(step_logits) if step_logits else None, "num_pages": runner.info.num_pages}


if __name__ == "__main__":
    main()
