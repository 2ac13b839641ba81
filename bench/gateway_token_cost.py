"""The gateway's Python per streamed token, in one process: GenerateMany's path over a router
Stream call that answers in place.

    .venv/bin/python -m bench.gateway_token_cost [--streams 128] [--steps 1500] [--max-tokens 128] [--rounds 5]

What the stack bench's "gateway us/tok" holds apart from grpc's own cost per message, for a
GenerateMany call: each request's way through the servicer (validation, prompt tokenization,
routing), the router Stream's demultiplexing of a step's message (bare tokens, first and last
updates), each request's task and generator chain, detokenizing, metrics, the call's outbox and
the building and serializing of its response messages. The router is a fake `Stream` call in
the same process: each step it writes one message for every open request (the first token and
the last as updates with usage, the others bare, the paragraph of `bench.fake_worker_group`
as text), serialized and parsed as grpc would; its own time is taken out. A step is written
once the call's previous message was read, and a request that ends starts the next one, as the
stack bench's load generator does. Thread CPU time of the event loop's thread (prompt
tokenization, which the gateway runs in its thread pool, is not in it), so the figure holds on
a busy machine better than the stack bench's; pair it with a checkout of the code before a
change (run this file from that checkout's root).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time

from bench.fake_worker_group import DEFAULT_MODEL, text_token_ids
from gateway_service.caller import Caller
from gateway_service.chat_format import ChatFormat
from gateway_service.config import GatewayConfig
from gateway_service.many_call import ManyCall
from gateway_service.metrics import API_GRPC_MANY
from gateway_service.router_choice import RouterPool
from gateway_service.service import GenerationServicer
from gateway_service.tokenizer import Tokenizer
from radixserve.heap import freeze_startup_heap
from radixserve.v1 import generation_pb2, router_pb2

ADDRESS = "in-process:1"  # never dialled: the pool gets a fake stub for it (a host:port, as the config checks)
PROMPT = "Request {}: write a short story about a lighthouse keeper and the sea."
CONTEXT_LEN = 4096
OPEN_TIMEOUT_S = 30.0


class FakeStreamCall:
    """A router's side of one Stream call, in place: `write` takes opens and cancels, iterating
    gives a step's message whenever `next_step` is set and `streams` requests are open (a
    request that ended is followed by the next one, whose open comes after its prompt is
    tokenized)."""

    def __init__(self, text: list[int], streams: int) -> None:
        self.text = text
        self.streams = streams
        self.open: dict[str, list[int]] = {}  # request id -> [prompt tokens, tokens so far, max tokens]
        self.next_step = asyncio.Event()
        self.all_open = asyncio.Event()
        self.fake_s = 0.0  # thread CPU spent here (taken out of the figures)
        self.num_steps = 0

    async def write(self, message: router_pb2.RouterStreamRequest) -> None:
        started = time.thread_time()
        message = router_pb2.RouterStreamRequest.FromString(message.SerializeToString())
        if message.HasField("open"):
            request = message.open
            self.open[request.request_id] = [len(request.prompt_token_ids), 0, request.max_tokens]
            if len(self.open) >= self.streams:
                self.all_open.set()
        else:
            self.open.pop(message.cancel, None)
        self.fake_s += time.thread_time() - started

    def cancel(self) -> bool:
        return True

    def __aiter__(self):
        return self

    async def __anext__(self) -> router_pb2.RouterStreamResponse:
        await self.next_step.wait()
        self.next_step.clear()
        while len(self.open) < self.streams:
            self.all_open.clear()
            try:
                await asyncio.wait_for(self.all_open.wait(), OPEN_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise RuntimeError(f"{self.streams - len(self.open)} requests did not open in {OPEN_TIMEOUT_S}s") from None
        started = time.thread_time()
        message = router_pb2.RouterStreamResponse()
        ended = []
        for request_id, state in self.open.items():
            prompt_tokens, done, max_tokens = state
            token_id = self.text[(prompt_tokens + done) % len(self.text)]
            done = state[1] = done + 1
            if done == 1 or done == max_tokens:
                update = message.updates.add(request_id=request_id)
                response = update.response
                response.token_ids.append(token_id)
                usage = response.usage
                usage.prompt_tokens, usage.completion_tokens = prompt_tokens, done
                if done == max_tokens:
                    response.finish_reason = generation_pb2.FINISH_REASON_LENGTH
                    ended.append(request_id)
            else:
                message.bare_request_ids.append(request_id)
                message.bare_token_ids.append(token_id)
        for request_id in ended:
            del self.open[request_id]
        data = message.SerializeToString()
        self.num_steps += 1
        self.fake_s += time.thread_time() - started
        return router_pb2.RouterStreamResponse.FromString(data)


class FakeStub:
    def __init__(self, call: FakeStreamCall) -> None:
        self.call = call

    def Stream(self, metadata=()) -> FakeStreamCall:
        return self.call


def server_info(vocab_size: int, eos: list[int]) -> router_pb2.GetServerInfoResponse:
    model = generation_pb2.GetModelInfoResponse(model_name="fake-stack", context_len=CONTEXT_LEN, tp_size=1,
                                                page_size=16, dtype="bfloat16", num_pages=1 << 16)
    return router_pb2.GetServerInfoResponse(model=model, eos_token_ids=eos, vocab_size=vocab_size)


async def measure(args: argparse.Namespace) -> tuple[float, float, int]:
    """(us of event-loop thread CPU per token, the same per step, tokens) over --steps steps."""
    text, vocab_size, eos = text_token_ids(args.model)
    config = GatewayConfig(routers=(ADDRESS,), model=args.model, metrics_port=0, http_port=0)
    pool = RouterPool((ADDRESS,), config.affinity_tokens, config.probe_timeout_s, bounds=config.bounds)
    call = FakeStreamCall(text, args.streams)
    pool._stubs[ADDRESS] = FakeStub(call)
    pool._up[ADDRESS] = True
    pool._info[ADDRESS] = server_info(vocab_size, eos)
    servicer = GenerationServicer(config, pool)
    tokenizer = Tokenizer.load(args.model)
    servicer.tokenizer = tokenizer
    servicer.chat = ChatFormat.detect(tokenizer, config.tool_call_parser, config.reasoning_parser)
    many = ManyCall(lambda request, caller, sink: servicer.generate(request, None, API_GRPC_MANY, caller, sink=sink),
                    lambda request, index: Caller(f"bench-{index}"), 1 << 20, lambda: False)
    outgoing: asyncio.Queue[generation_pb2.ManyRequest | None] = asyncio.Queue()
    next_id = 0

    def start() -> None:
        nonlocal next_id
        request = generation_pb2.GenerateRequest(
            prompt=PROMPT.format(next_id), max_tokens=args.max_tokens, ignore_eos=True,
            sampling=generation_pb2.SamplingParams(temperature=0.0))
        outgoing.put_nowait(generation_pb2.ManyRequest(id=next_id, generate=request))
        next_id += 1

    async def requests():
        while (message := await outgoing.get()) is not None:
            yield message

    freeze_startup_heap("bench")  # as the gateway does once it serves
    for _ in range(args.streams):
        start()
    warm_steps = args.steps // 5
    tokens = 0
    cpu0 = fake0 = None
    try:
        call.next_step.set()
        async for message in many.responses(requests()):
            message.SerializeToString()  # what grpc does with it
            for update in message.updates:
                tokens += len(update.response.token_ids)
                if update.response.finish_reason or update.code:
                    start()
            if call.num_steps == warm_steps and cpu0 is None:  # the measured steps begin
                cpu0, fake0, tokens = time.thread_time(), call.fake_s, 0
            if call.num_steps >= warm_steps + args.steps:
                break
            call.next_step.set()
        cpu1, fake1 = time.thread_time(), call.fake_s
    finally:
        outgoing.put_nowait(None)
        servicer.close()
    used = (cpu1 - cpu0) - (fake1 - fake0)
    return 1e6 * used / tokens, 1e6 * used / args.steps, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the router Stream's warning as each round ends
    per_token = []
    for round_index in range(args.rounds):
        us_token, us_step, tokens = asyncio.run(measure(args))
        per_token.append(us_token)
        print(f"round {round_index + 1}: {us_token:.2f} us a token, {us_step:.0f} us a step "
              f"({tokens} tokens, {tokens / args.steps:.1f} a step)", flush=True)
    print(f"median {statistics.median(per_token):.2f} us of gateway Python per token "
          f"({args.streams} streams, {args.max_tokens} tokens a request)")


if __name__ == "__main__":
    main()
