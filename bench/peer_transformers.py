"""The peer: the same workloads through transformers' `generate`, batched with left padding.

Run as a separate process (`python -m bench.peer_transformers --job job.json --out out.json`)
so that its peak memory is its own. Conversations are taken `concurrency` at a time; each group
runs its turns in lockstep, one batched `generate` per turn (transformers keeps no cache between
calls, so every turn recomputes its whole conversation). A request's time to first token is
counted from the start of its batch, as a closed-loop client would see it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from bench.records import RequestRecord, summarize
from bench.workloads import Workload, build_messages, lockstep_turns


class StepClock(StoppingCriteria):
    """Records when each generation step finished; never stops generation."""

    def __init__(self) -> None:
        self.times_s: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        self.times_s.append(time.monotonic())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def sampling_kwargs(workload: Workload) -> dict:
    """`generate`'s arguments for the workload's sampling (greedy, or draws at its temperature)."""
    if workload.temperature <= 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": workload.temperature, "top_p": workload.top_p, "top_k": 0}


def run_peer(model_dir: str, workload: Workload, concurrency: int, time_limit_s: float, dtype: str = "float32"
             ) -> tuple[list[RequestRecord], float]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    # ignore_eos: generate exactly max_tokens, as the server does.
    model.generation_config.eos_token_id = None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    with torch.inference_mode():  # warm-up, as the server side gets one
        model.generate(**tokenizer(["Hello"], return_tensors="pt"), max_new_tokens=4, pad_token_id=pad_id)
    records: list[RequestRecord] = []
    started = time.monotonic()
    for turn, active, histories in lockstep_turns(workload, concurrency, time_limit_s):
        texts = [
            tokenizer.apply_chat_template(
                build_messages(workload.system_prompt, histories[c], workload.conversations[c][turn]),
                add_generation_prompt=True, tokenize=False)
            for c in active
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        clock = StepClock()
        batch_start = time.monotonic()
        with torch.inference_mode():
            output = model.generate(
                **batch, max_new_tokens=workload.max_tokens, **sampling_kwargs(workload),
                pad_token_id=pad_id, stopping_criteria=StoppingCriteriaList([clock]),
            )
        prompt_lens = batch["attention_mask"].sum(dim=1).tolist()
        new_tokens = output[:, batch["input_ids"].shape[1]:]
        for row, c in enumerate(active):
            records.append(RequestRecord(
                conversation=c, turn=turn, start_s=batch_start, end_s=clock.times_s[-1],
                first_token_s=clock.times_s[0], token_times_s=list(clock.times_s),
                prompt_tokens=int(prompt_lens[row]), completion_tokens=int(new_tokens.shape[1]),
            ))
            reply = tokenizer.decode(new_tokens[row], skip_special_tokens=True)
            histories[c].append((workload.conversations[c][turn], reply))
    return records, time.monotonic() - started


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description="Run benchmark jobs through transformers.generate")
    parser.add_argument("--job", type=Path, required=True, help="JSON list of jobs from bench.run_all")
    parser.add_argument("--out", type=Path, required=True, help="where to write the results JSON")
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--dtype", default="float32", help="the model's dtype")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    jobs = json.loads(args.job.read_text())
    results = []
    for job in jobs:
        workload = Workload(**job["workload"])
        records, wall_s = run_peer(job["model_dir"], workload, job["concurrency"], job["time_limit_s"], args.dtype)
        summary = summarize(records, wall_s)
        results.append({"workload": workload.name, "concurrency": job["concurrency"], **summary})
        print(f"[peer] {workload.name} c={job['concurrency']}: "
              f"{summary['output_tokens_per_s']} out tok/s, ttft p50 {summary['ttft_p50_ms']} ms", flush=True)
    args.out.write_text(json.dumps({"results": results, "peak_rss_mb": round(peak_rss_mb(), 1)}, indent=2))


if __name__ == "__main__":
    main()
