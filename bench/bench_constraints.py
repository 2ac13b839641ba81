"""Cost of constrained decoding in rank 0's executor: step time of a batch of 32 decode rows with
0, 1, 8 and 32 of them constrained by a JSON schema, as a ratio to the unconstrained step.

    .venv/bin/python -m bench.bench_constraints [--model DIR] [--steps 16] [--rounds 3] [--threads 1,2]

The executor runs as in a worker (model forward, constraint masks, sampler), without gRPC. Every
request is greedy and the schema asks for a long array, so constrained rows keep being
constrained for every measured step. All configurations decode side by side and take
turns step by step (the machine may be shared: neighbouring steps see the same load); each figure
is a median over all rounds, and the ratio is to the 0-constrained median of the same run. The
time spent masking (bitmask fill and applying it) is also timed on its own, since it is the
whole cost constraints add and, unlike the step time, hardly moves with the machine's load.
Goal (issue 14): <= 1.10x with 32 constrained.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from radixserve import constraints, sampling  # noqa: E402
from radixserve.constraints import Constraint, ConstraintKind  # noqa: E402
from radixserve.sampling import SamplingParams  # noqa: E402
from radixserve.v1 import worker_pb2 as pb  # noqa: E402
from worker_service.executor import Executor  # noqa: E402
from worker_service.grammar import ConstraintMasks  # noqa: E402
from worker_service.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from worker_service.sampling import Sampler  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "smollm2-135m-instruct"
BATCH = 32
GOAL_RATIO = 1.10
SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array", "minItems": 50,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "age": {"type": "integer", "minimum": 0, "maximum": 130},
                    "role": {"enum": ["admin", "editor", "viewer"]},
                    "score": {"type": "number", "minimum": 0, "maximum": 1},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "age", "role", "address"],
            },
        },
    },
    "required": ["people"],
}
PROMPT = "List fifty people as JSON, with their name, age, role, score, tags and address:"


class Batch:
    """BATCH greedy requests, `num_constrained` of them under SCHEMA, decoding in one executor."""

    def __init__(self, executor: Executor, prompt_ids: list[int], num_constrained: int, tag: str,
                 max_len: int) -> None:
        self.executor, self.task_id = executor, 0
        page_size = executor.info.page_size
        pages_each = (max_len + page_size - 1) // page_size
        constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
        self.ids = [f"{tag}-{i}" for i in range(BATCH)]
        entries = [
            pb.TaskEntry(
                request_id=rid, token_ids=prompt_ids, page_ids=range(i * pages_each, (i + 1) * pages_each),
                sample=True, new_request=pb.NewRequest(
                    sampling=sampling.to_proto(SamplingParams()), num_prompt_tokens=len(prompt_ids),
                    constraint=constraints.to_proto(constraint if i < num_constrained else None)))
            for i, rid in enumerate(self.ids)
        ]
        self.position = len(prompt_ids)
        self.last = self._run(entries)

    def _run(self, entries: list[pb.TaskEntry]) -> list[int]:
        self.task_id += 1
        result = self.executor.execute(pb.DecodeTask(task_id=self.task_id, entries=entries))
        if result.HasField("error"):
            raise RuntimeError(result.error.message)
        return [token.token_id for token in result.tokens]

    def step(self) -> float:
        """One decode step of the whole batch; its wall time in seconds."""
        entries = [pb.TaskEntry(request_id=rid, token_ids=[token], start_position=self.position, sample=True)
                   for rid, token in zip(self.ids, self.last)]
        start = time.perf_counter()
        self.last = self._run(entries)
        elapsed = time.perf_counter() - start
        self.position += 1
        return elapsed

    def release(self) -> None:
        self.task_id += 1
        self.executor.execute(pb.DecodeTask(task_id=self.task_id, release_request_ids=self.ids))


def measure(executor: Executor, prompt_ids: list[int], counts: list[int], steps: int, rounds: int
            ) -> tuple[dict[int, float], dict[int, float]]:
    """Median step time (s) and median mask time (s) per constrained count.

    Every round keeps one batch per count alive and steps them in turn, rotating the order each
    step, so that all counts see the same load on a shared machine.
    """
    times: dict[int, list[float]] = {count: [] for count in counts}
    mask_times: dict[int, list[float]] = {count: [] for count in counts}
    masks = executor.constraints
    spent = [0.0]
    original = masks.mask

    def timed_mask(logits, rows):
        start = time.perf_counter()
        out = original(logits, rows)
        spent[0] += time.perf_counter() - start
        return out

    masks.mask = timed_mask
    max_len = len(prompt_ids) + steps + 1
    for round_index in range(rounds):
        batches = {count: Batch(executor, prompt_ids, count, f"r{round_index}c{count}", max_len) for count in counts}
        for batch in batches.values():
            batch.step()  # warm-up: the first decode of a fresh batch
        for step_index in range(steps - 1):
            shift = step_index % len(counts)
            for count in counts[shift:] + counts[:shift]:
                spent[0] = 0.0
                times[count].append(batches[count].step())
                mask_times[count].append(spent[0])
        for batch in batches.values():
            batch.release()
    masks.mask = original
    return ({count: statistics.median(values) for count, values in times.items()},
            {count: statistics.median(values) for count, values in mask_times.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-threads", type=int, default=2, help="torch threads")
    parser.add_argument("--threads", default="1", help="constraint fill threads to compare, comma-separated")
    parser.add_argument("--counts", default="0,1,8,32", help="constrained requests in the batch of 32")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per batch and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    torch.set_num_threads(args.num_threads)
    counts = [int(c) for c in args.counts.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    runner = ModelRunner(RunnerConfig(model_dir=args.model, dtype=args.dtype, kv_cache_bytes=256 << 20))
    print(f"model {args.model.name} {args.dtype}, torch threads {torch.get_num_threads()}, batch {BATCH}, "
          f"{args.steps} steps x {args.rounds} rounds, load average {os.getloadavg()[0]:.2f} at start")
    for threads in (int(t) for t in args.threads.split(",")):
        masks = ConstraintMasks.load(args.model, runner.info.vocab_size, list(runner.info.eos_token_ids), 16, threads)
        executor = Executor(runner, Sampler(seed=0), constraints=masks)
        medians, mask_medians = measure(executor, prompt_ids, counts, args.steps, args.rounds)
        base = medians[counts[0]]
        print(f"\nconstraint fill threads {threads}")
        print(f"{'constrained':>12} | {'step ms (median)':>17} | {'ratio':>6} | {'mask ms (median)':>16} | {'(base + mask) / base':>20}")
        for count in counts:
            masked = (base + mask_medians[count]) / base
            print(f"{count:>12} | {medians[count] * 1000:>17.1f} | {medians[count] / base:>5.3f}x | "
                  f"{mask_medians[count] * 1000:>16.2f} | {masked:>19.3f}x")
        if 32 in medians:
            verdict = "met" if medians[32] / base <= GOAL_RATIO else "NOT met"
            print(f"goal <= {GOAL_RATIO:.2f}x at 32 constrained: {verdict}")
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
