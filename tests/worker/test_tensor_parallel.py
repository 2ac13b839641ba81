"""Tensor parallelism on CPU (gloo): TP ranks as real processes give what one rank gives.

Each rank runs `tp_rank.py` as a script: it joins the group, loads only its shard,
computes the prompt's logits and a greedy continuation (rank 0 picks each token and broadcasts
it, as the real rank 0 would return it to the router), and saves what it saw for the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from worker.backend_params import backend_params
from worker_service.layers.sharding import balanced_range, shard_heads

ROOT = Path(__file__).resolve().parents[2]
RANK_SCRIPT = Path(__file__).with_name("tp_rank.py")
NUM_NEW_TOKENS = 32
RANK_TIMEOUT_S = 150.0
# Partial sums are added in another order (all-reduce of per-rank halves): measured ~2e-5 on
# SmolLM2 and ~1e-7 on the tiny models.
SMOLLM2_ATOL = 1e-3
TINY_ATOL = 1e-4


def test_heads_split_by_whole_kv_groups() -> None:
    # SmolLM2 at TP=2: 9 q / 3 kv heads -> 6 q + 2 kv on rank 0, 3 q + 1 kv on rank 1.
    assert shard_heads(9, 3, 2, 0).q_heads == range(0, 6) and shard_heads(9, 3, 2, 0).kv_heads == range(0, 2)
    assert shard_heads(9, 3, 2, 1).q_heads == range(6, 9) and shard_heads(9, 3, 2, 1).kv_heads == range(2, 3)
    # More ranks than KV heads: each rank holds one (replicated) KV head and part of its group.
    shards = [shard_heads(6, 3, 4, rank) for rank in range(4)]
    assert [s.kv_heads for s in shards] == [range(0, 1), range(0, 1), range(1, 2), range(2, 3)]
    assert [s.q_heads for s in shards] == [range(0, 1), range(1, 2), range(2, 4), range(4, 6)]
    with pytest.raises(ValueError, match="without a query head"):
        shard_heads(2, 1, 3, 2)
    for total, parts in [(49152, 2), (7, 3), (128, 4)]:
        ranges = [balanced_range(total, parts, p) for p in range(parts)]
        assert [i for r in ranges for i in r] == list(range(total))


def run_ranks(model_dir: Path | list[Path], prompt_ids: list[int], world_size: int, work_dir: Path, backend: str,
              quantization: str = "none", timeout_s: float | None = None) -> list:
    """Start `world_size` rank processes, wait for all (bounded), return what each saved (for a
    list of model folders, each rank's list of results, one per model, run in one group).

    Every process is killed on the way out, whether the ranks finished, failed or hung.
    """
    from procs import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen] = []
    logs = [work_dir / f"rank{rank}.log" for rank in range(world_size)]
    outs = [work_dir / f"rank{rank}.pt" for rank in range(world_size)]
    try:
        for rank in range(world_size):
            with open(logs[rank], "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(RANK_SCRIPT), "--rank", str(rank), "--world-size", str(world_size),
                     "--master-port", str(port), "--model",
                     *map(str, model_dir if isinstance(model_dir, list) else [model_dir]),
                     "--prompt", json.dumps(prompt_ids), "--out", str(outs[rank]), "--backend", backend,
                     "--quantization", quantization],
                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,
                ))
        deadline = time.monotonic() + (timeout_s or RANK_TIMEOUT_S)
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                tails = "\n".join(f"--- rank {r} ---\n{logs[r].read_text(errors='replace')[-3000:]}"
                                  for r in range(world_size))
                pytest.fail(f"ranks {failed or 'timed out'}:\n{tails}")
            time.sleep(0.1)
        for rank, proc in enumerate(procs):
            assert proc.returncode == 0, logs[rank].read_text(errors="replace")[-3000:]
        return [torch.load(out) for out in outs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def single_rank(model_dir: Path, prompt_ids: list[int], backend: str,
                quantization: str = "none") -> tuple[torch.Tensor, list[int], int]:
    from worker.tiny_models import greedy_tokens
    from worker_service.forward_batch import ForwardEntry
    from worker_service.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_bytes=32 << 20, attention_kernel=backend,
                                      quantization=quantization))
    assert runner.backend.name == backend
    page_table = list(range((len(prompt_ids) + NUM_NEW_TOKENS) // runner.info.page_size + 1))
    logits = runner.forward([ForwardEntry(prompt_ids, 0, page_table, True)])
    return logits, greedy_tokens(runner, prompt_ids, NUM_NEW_TOKENS, page_table), runner.weight_bytes()


def check_against_single_rank(model_dir: Path | list[Path], prompt_ids: list[int], world_size: int,
                              work_dir: Path, atol: float, backend: str, quantization: str = "none") -> list:
    """TP=`world_size` against TP=1 for one model (each rank's result) or several run in one
    group of rank processes (each rank's list of results, one per model)."""
    models = model_dir if isinstance(model_dir, list) else [model_dir]
    singles = [single_rank(model, prompt_ids, backend, quantization) for model in models]
    per_rank = run_ranks(models, prompt_ids, world_size, work_dir, backend, quantization)
    per_model = [[results[i] for results in per_rank] for i in range(len(models))] if len(models) > 1 \
        else [per_rank]
    for (logits, tokens, total_bytes), results in zip(singles, per_model):
        assert results[0]["tokens"] == tokens
        assert all(r["tokens"] == tokens for r in results)
        torch.testing.assert_close(results[0]["prompt_logits"], logits, atol=atol, rtol=0)
        assert all(r["prompt_logits"] is None for r in results[1:])
        for result in results:
            # Each rank holds about 1/world_size (measured on SmolLM2 at TP=2: 0.53 and 0.47; the
            # uneven head split gives rank 0 two of the three KV groups).
            share = result["weight_bytes"] / total_bytes
            assert 0.8 / world_size <= share <= 1.3 / world_size, f"rank holds {share:.2f} of the weights"
    return per_rank


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", backend_params(head_dim=64))
def test_smollm2_tp2_matches_tp1(smollm2_dir, tmp_path, backend) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt_ids = tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]
    results = check_against_single_rank(smollm2_dir, prompt_ids, 2, tmp_path, SMOLLM2_ATOL, backend)
    # Rank 0 holds 2 of the 3 KV heads, so its page budget buys fewer pages than rank 1's.
    assert results[0]["num_pages"] < results[1]["num_pages"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize(("arch", "world_size"), [("qwen2", 2), ("llama", 4)])
def test_tiny_model_tp_matches_tp1(arch, world_size, tmp_path, backend) -> None:
    """Qwen2 (biases, untied head) at TP=2; Llama at TP=4, more ranks than its 3 KV heads."""
    from worker.tiny_models import make_tiny_llama, make_tiny_qwen2

    model_dir = (make_tiny_qwen2 if arch == "qwen2" else make_tiny_llama)(tmp_path / "model")
    check_against_single_rank(model_dir, list(range(3, 40)), world_size, tmp_path, TINY_ATOL, backend)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", backend_params())
def test_tiny_model_int4_and_gguf_tp2_match_tp1(tmp_path, backend) -> None:
    """int4 in groups of 32 at TP=2 as at TP=1: the tiny Llama's row-parallel shards split K on
    multiples of 32 (o_proj 64 + 32, down_proj 64 + 64), so each rank quantizes whole groups of
    the TP=1 weight and TP=2 computes what TP=1 computes. (int8's scales are per output channel
    of each rank's shard, so a row-parallel layer's differ from TP=1's: no such equality.)
    In the same rank pair, a GGUF file's quantized weights sharded as they are (Q4_K_M's mix):
    column-parallel ones by whole rows, row-parallel ones (o_proj 128 + 128 columns, down_proj
    256 + 256) on whole groups of Q4_K's 32 and Q6_K's 16 columns."""
    from worker.tiny_gguf import MIXED, write_tiny_gguf
    from worker.tiny_models import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path / "model")
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", MIXED)
    check_against_single_rank([model_dir, gguf_path], list(range(3, 40)), 2, tmp_path, TINY_ATOL, backend, "int4")
