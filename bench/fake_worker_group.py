"""A fake worker group for the stack benchmark: one rank that answers each step after a set time.

    python -m bench.fake_worker_group --port P --step-ms 5 [--model models/smollm2-135m-instruct]

It serves the real `WorkerService` (GetWorkerInfo, Execute) over gRPC, so the router drives it
exactly as it drives real workers: it keeps each request's position, honours `reset`,
releases and the overlap references (`sampled_in_task`), and answers every task in order. A
task is answered `--step-ms` after the rank could start it, as a forward pass of that length
would be: the later of its arrival (stamped by a reader of its own, so a task sent ahead, as
overlap scheduling does, counts from when it came, not from when the rank got round to reading
it) and the previous task's end as scheduled (a GPU does not oversleep as the event loop's
timers do: that lateness is the fake's, not the stack's, and is not carried into the next
step). The sampled tokens walk through a paragraph tokenized with the model's own tokenizer, so
the gateway detokenizes real text; logprobs are sent when a request asks for them. It costs
little CPU of its own, so what the benchmark measures is the gateway's and the router's.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator

import grpc

from bench.processes import take_harness_priority
from radixserve.serving import start_server
from radixserve.v1 import worker_pb2, worker_pb2_grpc

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
DEFAULT_MODEL = "models/smollm2-135m-instruct"
PAGE_SIZE = 16
NUM_PAGES = 1 << 16
CONTEXT_LEN = 8192
# What the rank reports as its device: not the CPU, for its steps cost the host none (as a GPU's
# forward pass leaves the CPU to the router), so the router's overlap default is on, as for CUDA.
DEVICE = "fake"
LOGPROB = -0.5  # what every sampled token reports when logprobs are asked for
# The text the fake samples: ordinary prose, multi-byte characters included.
TEXT = (
    "A radix tree keeps every prompt the server has seen as a path of pages, so a new request "
    "that starts the same way reuses the keys and values already computed instead of running "
    "them again. Café owners in Zürich know the same trick: the first cup of the morning warms "
    "the machine, and every later one is quicker. The scheduler batches requests together, "
    "one step at a time, and streams each new token back as soon as it is sampled — "
    "«вот так» or 这样 or just like this. "
)


def text_token_ids(model_dir: str) -> tuple[list[int], int, list[int]]:
    """The paragraph's token ids, the vocabulary size and the end-of-sequence ids."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    eos = config.get("eos_token_id", [])
    return tokenizer.encode(TEXT, add_special_tokens=False).ids, config["vocab_size"], eos if isinstance(eos, list) else [eos]


class FakeWorkerGroup(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, step_s: float, token_ids: list[int], vocab_size: int, eos_token_ids: list[int]) -> None:
        self.step_s = step_s
        self.token_ids = token_ids
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        # Per request: whether it wants logprobs. (Positions come with every entry.)
        self.logprobs: dict[str, bool] = {}

    async def GetWorkerInfo(self, request, context) -> worker_pb2.GetWorkerInfoResponse:
        return worker_pb2.GetWorkerInfoResponse(
            rank=0, world_size=1, model_name="fake-stack", dtype="float32", page_size=PAGE_SIZE,
            num_pages=NUM_PAGES, context_len=CONTEXT_LEN, vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids, device=DEVICE, quantization="none",
        )

    async def Execute(self, request_iterator: AsyncIterator[worker_pb2.DecodeTask], context) -> AsyncIterator[worker_pb2.TaskResult]:
        loop = asyncio.get_running_loop()
        arrivals: asyncio.Queue[tuple[worker_pb2.DecodeTask | None, float]] = asyncio.Queue()

        async def read() -> None:
            try:
                async for task in request_iterator:
                    arrivals.put_nowait((task, loop.time()))
            finally:
                arrivals.put_nowait((None, 0.0))

        reader = asyncio.ensure_future(read())
        free_at = loop.time()  # when the rank's previous task ended, as scheduled
        try:
            while True:
                task, arrived = await arrivals.get()
                if task is None:
                    await reader  # its error, if the call broke
                    return
                start = max(arrived, free_at)
                result = self.run(task)
                result.idle_before_s = max(0.0, arrived - free_at)
                free_at = start + self.step_s
                delay = free_at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                yield result
        finally:
            reader.cancel()

    def run(self, task: worker_pb2.DecodeTask) -> worker_pb2.TaskResult:
        result = worker_pb2.TaskResult(task_id=task.task_id, rank=0)
        if task.reset:
            self.logprobs.clear()
        for request_id in task.release_request_ids:
            self.logprobs.pop(request_id, None)
        text = self.token_ids
        for entry in task.entries:
            request_id = entry.request_id
            if entry.HasField("new_request"):
                self.logprobs[request_id] = entry.new_request.sampling.logprobs
            # A referred token (overlap) is one more written position.
            end = entry.start_position + len(entry.token_ids) + (1 if entry.sampled_in_task else 0)
            if not entry.sample:
                continue
            # The text's token at position p is what sampling after position p - 1 draws; drafts
            # are accepted while they match it.
            drafts = list(entry.token_ids)[len(entry.token_ids) - entry.num_draft_tokens:] if entry.num_draft_tokens else []
            position = end - len(drafts)
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == text[(position + accepted) % len(text)]:
                accepted += 1
            position += accepted
            wants = self.logprobs.get(request_id, False)
            sampled = result.tokens.add(request_id=request_id, token_id=text[position % len(text)],
                                        logprob=LOGPROB if wants else 0.0, num_accepted_drafts=accepted)
            if wants:
                for draft in drafts[:accepted]:
                    sampled.accepted_logprobs.add(token_id=draft, logprob=LOGPROB)
        return result


async def serve(port: int, step_s: float, model_dir: str) -> None:
    token_ids, vocab_size, eos = text_token_ids(model_dir)
    worker = FakeWorkerGroup(step_s, token_ids, vocab_size, eos)
    server, health, _ = await start_server(
        "127.0.0.1", port, [lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, s)],
        [SERVICE_NAME],
    )
    await health.set(True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--realtime", action="store_true",
                        help="run under SCHED_FIFO where permitted (bench.processes.take_harness_priority)")
    args = parser.parse_args()
    if args.realtime:
        take_harness_priority()
    asyncio.run(serve(args.port, args.step_ms / 1000, args.model))


if __name__ == "__main__":
    main()
