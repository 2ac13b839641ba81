"""The worker executor's Python overhead per decode step, and whether it grows with the context.

    .venv/bin/python -m bench.bench_step_overhead [--batch 32] [--contexts 500,16000] [--steps 200] [--vocab 256]

A fake runner (no model: zero logits over a --vocab of tokens) isolates what the executor itself
does in a step: parse the DecodeTask, validate it, grow the request states, build the forward
batch, sample greedily, answer a TaskResult. For each context length, --batch requests are
prefilled to it, then decode --steps steps; the median step time is printed, and the ratio of
the longest context's to the shortest's. The goal (issue 10, "nothing on the step path scales
with total tokens") is a ratio near 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from radixserve import sampling  # noqa: E402
from radixserve.heap import freeze_startup_heap  # noqa: E402
from radixserve.v1 import worker_pb2  # noqa: E402
from worker_service.executor import Executor  # noqa: E402
from worker_service.forward_batch import ForwardEntry  # noqa: E402
from worker_service.sampling import Sampler  # noqa: E402

PAGE_SIZE = 16
VOCAB = 256  # by default small, so that the sampler's tensor work does not hide the Python work
GOAL_RATIO = 1.5


class ZeroRunner:
    """Logits of zeros for every sampled entry; the executor never knows the difference."""

    def __init__(self, info: worker_pb2.GetWorkerInfoResponse) -> None:
        self.info = info

    def forward(self, entries: list[ForwardEntry]) -> torch.Tensor:
        return torch.zeros(sum(entry.sample for entry in entries), self.info.vocab_size)


def median_step_s(batch: int, context: int, steps: int, vocab: int = VOCAB) -> float:
    pages_each = (context + steps) // PAGE_SIZE + 1
    info = worker_pb2.GetWorkerInfoResponse(
        model_name="zero", dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=batch * pages_each,
        context_len=context + steps, vocab_size=vocab, eos_token_ids=[0], rank=0, world_size=1,
    )
    executor = Executor(ZeroRunner(info), Sampler(seed=0))
    prefill = worker_pb2.DecodeTask(task_id=0)
    for i in range(batch):
        entry = prefill.entries.add(
            request_id=f"r{i}", token_ids=[(i + t) % vocab for t in range(context)],
            page_ids=range(i * pages_each, (i + 1) * pages_each), sample=True,
        )
        entry.new_request.sampling.CopyFrom(sampling.to_proto(sampling.SamplingParams()))
        entry.new_request.num_prompt_tokens = context
    times = []
    for step in range(-1, steps):
        task = prefill
        if step >= 0:
            task = worker_pb2.DecodeTask(task_id=step + 1)
            for i in range(batch):
                task.entries.add(request_id=f"r{i}", token_ids=[1], start_position=context + step, sample=True)
        data = task.SerializeToString()  # timed from the bytes, as the service receives it
        started = time.perf_counter()
        result = executor.execute(worker_pb2.DecodeTask.FromString(data))
        times.append(time.perf_counter() - started)
        if result.HasField("error"):
            raise RuntimeError(result.error.message)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", default="500,16000", help="context lengths, comma-separated")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=VOCAB,
                        help="logits per row (a real model's, e.g. 49152, to count the sampler's argmax)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    freeze_startup_heap("bench_step_overhead")  # as the worker does once loaded: no full scans of torch's objects
    contexts = sorted(int(c) for c in args.contexts.split(","))
    medians = {}
    for context in contexts:
        medians[context] = median_step_s(args.batch, context, args.steps, args.vocab)
        print(f"batch {args.batch}, context {context:>6}: decode step {medians[context] * 1e6:8.0f} us (median)")
    ratio = medians[contexts[-1]] / medians[contexts[0]]
    verdict = "met" if ratio <= GOAL_RATIO else "NOT met"
    print(f"context {contexts[-1]} / {contexts[0]}: {ratio:.2f}x (goal <= {GOAL_RATIO}x: {verdict})")


if __name__ == "__main__":
    main()
