"""The vLLM peer: the same workloads through vLLM's CPU engine, offline (`LLM.generate`, no HTTP).

Runs in vLLM's own virtualenv (`bench/peer_env.py` makes it), as a separate process:

    .peers/vllm/bin/python -m bench.peer_vllm --job job.json --out out.json --dtype bfloat16

Conversations are taken `concurrency` at a time; each group's turn is one `generate` call over
the group's prompts (vLLM batches them continuously and caches prefixes across calls), so a
request's timings are its batch's: start at the call, end when the call returns. Time to first
token is not observable offline and is left out. Imports only the standard library from this
project (`bench.workloads`, `bench.records`), since vLLM's virtualenv has no radixserve.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.records import RequestRecord, summarize
from bench.workloads import Workload, build_messages, lockstep_turns

# A short warm-up request first, as the other engines get one.
WARMUP_MAX_TOKENS = 4


def run_job(llm, tokenizer, workload: Workload, concurrency: int, time_limit_s: float
            ) -> tuple[list[RequestRecord], float]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=workload.temperature, top_p=workload.top_p, max_tokens=workload.max_tokens,
                            ignore_eos=True)
    records: list[RequestRecord] = []
    started = time.monotonic()
    for turn, active, histories in lockstep_turns(workload, concurrency, time_limit_s):
        texts = [tokenizer.apply_chat_template(
            build_messages(workload.system_prompt, histories[c], workload.conversations[c][turn]),
            add_generation_prompt=True, tokenize=False) for c in active]
        # Token ids, as the other engines get them: the template already holds its special tokens.
        prompts = [{"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)} for text in texts]
        batch_start = time.monotonic()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        batch_end = time.monotonic()
        for c, prompt, output in zip(active, prompts, outputs):
            completion = output.outputs[0]
            records.append(RequestRecord(
                conversation=c, turn=turn, start_s=batch_start, end_s=batch_end,
                prompt_tokens=len(prompt["prompt_token_ids"]),
                completion_tokens=len(completion.token_ids),
                cached_tokens=output.num_cached_tokens or 0,
            ))
            histories[c].append((workload.conversations[c][turn], completion.text))
    return records, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description="Run benchmark jobs through vLLM's CPU engine")
    parser.add_argument("--job", type=Path, required=True, help="JSON list of jobs from bench.run_all")
    parser.add_argument("--out", type=Path, required=True, help="where to write the results JSON")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM's model dtype")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="vLLM's context limit (default: the model's, as radixserve serves it)")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    jobs = json.loads(args.job.read_text())
    llm = LLM(model=jobs[0]["model_dir"], dtype=args.dtype, max_model_len=args.max_model_len,
              enable_prefix_caching=True, seed=0)
    tokenizer = llm.get_tokenizer()
    llm.generate(["Hello"], SamplingParams(max_tokens=WARMUP_MAX_TOKENS), use_tqdm=False)
    results = []
    for job in jobs:
        workload = Workload(**job["workload"])
        records, wall_s = run_job(llm, tokenizer, workload, job["concurrency"], job["time_limit_s"])
        summary = summarize(records, wall_s)
        results.append({"workload": workload.name, "concurrency": job["concurrency"], **summary})
        print(f"[vllm] {workload.name} c={job['concurrency']}: {summary['output_tokens_per_s']} out tok/s",
              flush=True)
    args.out.write_text(json.dumps({"results": results, "peak_rss_mb": None}, indent=2))


if __name__ == "__main__":
    main()
