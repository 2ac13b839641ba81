"""The llama.cpp peer: the same workloads through `llama-cpp-python` on the same GGUF file.

Runs in llama.cpp's own virtualenv (`make bench` builds `llama-cpp-python` from source into
`.peers/llamacpp`), as a separate process:

    .peers/llamacpp/bin/python -m bench.peer_llamacpp --job job.json --out out.json --gguf FILE

`llama-cpp-python`'s `Llama` runs one sequence at a time in one context, reusing the KV of the
longest prefix it shares with the sequence before it (its prefix cache). So a group of
`concurrency` conversations is run one request after another, each request timed on its own
(start, first token, every token, end); throughput is the group's tokens over the wall time,
as for the other engines. The prompt is the file's chat template rendered by llama-cpp-python's
own Jinja formatter, tokenized with its special tokens parsed; the replies are greedy (or
sampled at the workload's temperature and top_p) and run to max_tokens past an end of turn, as
the other engines' do (`ignore_eos`). Imports only the standard library from this project.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.records import RequestRecord, summarize
from bench.workloads import Workload, build_messages, lockstep_turns

WARMUP_MAX_TOKENS = 4
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


class LlamaCppEngine:
    """One `llama_cpp.Llama` over the GGUF file, and its chat template."""

    def __init__(self, gguf: Path, n_ctx: int, n_threads: int) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                         n_batch=512, verbose=False, seed=0)
        template = self.llm.metadata.get(CHAT_TEMPLATE_KEY)
        if not template:
            raise SystemExit(f"{gguf} has no {CHAT_TEMPLATE_KEY} in its metadata")
        eos = self.llm.detokenize([self.llm.token_eos()], special=True).decode(errors="replace")
        bos = self.llm.detokenize([self.llm.token_bos()], special=True).decode(errors="replace")
        self.format = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.format(messages=messages).prompt
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def cached_len(self, prompt: list[int]) -> int:
        """Tokens of `prompt` whose KV the context still holds from the sequence before."""
        held = list(self.llm.input_ids[: self.llm.n_tokens])
        same = 0
        for a, b in zip(held, prompt):
            if a != b:
                break
            same += 1
        return min(same, len(prompt) - 1)  # the last prompt token is always evaluated again

    def complete(self, record: RequestRecord, prompt: list[int], workload: Workload) -> str:
        record.cached_tokens = self.cached_len(prompt)
        out: list[int] = []
        for token in self.llm.generate(prompt, temp=workload.temperature, top_p=workload.top_p, reset=True):
            now = time.monotonic()
            record.first_token_s = record.first_token_s or now
            record.token_times_s.append(now)
            out.append(token)
            if len(out) >= workload.max_tokens:
                break
        record.completion_tokens = len(out)
        return self.llm.detokenize(out).decode(errors="replace")


def run_job(engine: LlamaCppEngine, workload: Workload, concurrency: int, time_limit_s: float
            ) -> tuple[list[RequestRecord], float]:
    records: list[RequestRecord] = []
    started = time.monotonic()
    for turn, active, histories in lockstep_turns(workload, concurrency, time_limit_s):
        for c in active:
            user = workload.conversations[c][turn]
            prompt = engine.prompt_ids(build_messages(workload.system_prompt, histories[c], user))
            record = RequestRecord(conversation=c, turn=turn, start_s=time.monotonic(), prompt_tokens=len(prompt))
            reply = engine.complete(record, prompt, workload)
            record.end_s = time.monotonic()
            records.append(record)
            histories[c].append((user, reply))
    return records, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description="Run benchmark jobs through llama.cpp (llama-cpp-python)")
    parser.add_argument("--job", type=Path, required=True, help="JSON list of jobs (bench.run_all's format)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the results JSON")
    parser.add_argument("--gguf", type=Path, required=True, help="the GGUF file radixserve serves too")
    parser.add_argument("--n-ctx", type=int, default=4096, help="llama.cpp's context length")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads")
    args = parser.parse_args()

    engine = LlamaCppEngine(args.gguf, args.n_ctx, args.threads)
    engine.llm.create_completion("Hello", max_tokens=WARMUP_MAX_TOKENS)
    results = []
    for job in json.loads(args.job.read_text()):
        workload = Workload(**job["workload"])
        records, wall_s = run_job(engine, workload, job["concurrency"], job["time_limit_s"])
        summary = summarize(records, wall_s)
        results.append({"workload": workload.name, "concurrency": job["concurrency"], **summary})
        print(f"[llama.cpp] {workload.name} c={job['concurrency']}: {summary['output_tokens_per_s']} out tok/s, "
              f"itl p50 {summary['itl_p50_ms']} ms, hit rate {summary['cache_hit_rate']}", flush=True)
    args.out.write_text(json.dumps({"results": results, "peak_rss_mb": None}, indent=2))


if __name__ == "__main__":
    main()
