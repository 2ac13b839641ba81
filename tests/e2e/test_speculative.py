"""Speculative decoding through real processes: outputs are identical with it on and off.

A tiny random Llama with SmolLM2's tokenizer serves (its greedy outputs fall into loops, so
n-gram drafts are often accepted). One worker group stays up while routers with speculation off
and on take turns on the same port, with one gateway in front: 50 random greedy prompts (some
repeating a passage) at TP=1, under a pool small enough to force retraction; seeded
sampling with penalties alone and batched; stop ids, max_tokens and gateway stop strings; usage
counters against the streamed tokens; cancellation gives every page back; speculation together
with overlap scheduling. At TP=2, speculation's outputs (greedy and seeded, drafts accepted) are
held to those without it by tests/e2e/test_determinism.py's TP=2 group.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from constrained_model import make_constrained_model
from procs import PYTHON, ServiceProcesses, free_port, is_serving
from radixserve.serving import CHANNEL_OPTIONS
from radixserve.v1 import generation_pb2, generation_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2

NUM_PROMPTS = 50
MAX_TOKENS = 32
SMALL_POOL_PAGES = 24  # 50 requests of up to ~6 pages each cannot all run at once
SEEDED = worker_pb2.ResolvedSamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.0,
                                           presence_penalty=0.4, has_seed=True, seed=2024)
TEXT_PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):"]
TIMEOUT_S = 120
SPEC_ON = ["--speculative", "--speculative-max-running", "64"]  # drafts even in a full batch
SPEC_OFF = ["--no-speculative"]


@dataclass
class Stack:
    procs: ServiceProcesses
    model_dir: str
    router_port: int
    gateway_address: str
    worker_addresses: list[str]

    @property
    def router_address(self) -> str:
        return f"127.0.0.1:{self.router_port}"

    def start_workers(self, tp: int) -> None:
        for name in [n for n in self.procs.procs if n.startswith("worker")]:
            self.procs.stop(name)
            del self.procs.procs[name]  # stopped on purpose: not a process that died
        ports = [free_port() for _ in range(tp)]
        master_port = free_port()
        for rank, port in enumerate(ports):
            self.procs.start(f"worker{rank}-tp{tp}", [
                PYTHON, "-m", "worker_service", "--model", self.model_dir, "--port", str(port),
                "--device", "cpu", "--dtype", "float32", "--kv-cache-mb", "16", "--log-level", "WARNING",
                "--rank", str(rank), "--world-size", str(tp), "--master-port", str(master_port),
            ])
        self.worker_addresses = [f"127.0.0.1:{port}" for port in ports]
        for address in self.worker_addresses:
            self.procs.wait_healthy(address, timeout_s=TIMEOUT_S)

    def router(self, *flags: str) -> None:
        """(Re)start the router on its port with `flags`; waits until the gateway sees it."""
        self.procs.stop("router")
        deadline = time.monotonic() + TIMEOUT_S
        while is_serving(self.gateway_address) and time.monotonic() < deadline:
            time.sleep(0.1)  # the gateway noticed the old router leave
        self.procs.start("router", [
            PYTHON, "-m", "router_service", "--port", str(self.router_port), "--workers",
            ",".join(self.worker_addresses), "--log-level", "WARNING", *flags,
        ])
        self.procs.wait_healthy(self.router_address, timeout_s=TIMEOUT_S)
        self.procs.wait_healthy(self.gateway_address, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2_dir) -> Iterator[Stack]:
    model_dir = str(make_constrained_model(tmp_path_factory.mktemp("spec"), smollm2_dir))
    router_port, gateway_port = free_port(), free_port()
    with ServiceProcesses() as procs:
        procs.start("gateway", [
            PYTHON, "-m", "gateway_service", "--model", model_dir, "--port", str(gateway_port),
            "--routers", f"127.0.0.1:{router_port}", "--probe-interval-s", "0.2", "--log-level", "WARNING",
        ])
        stack = Stack(procs, model_dir, router_port, f"127.0.0.1:{gateway_port}", [])
        stack.start_workers(1)
        yield stack


def prompts() -> list[list[int]]:
    rng = random.Random(12)
    result = []
    for index in range(NUM_PROMPTS):
        words = [rng.randrange(3, 49152) for _ in range(rng.randrange(3, 40))]
        if index % 2:  # a passage and its repetition: drafts from the prompt
            passage = [rng.randrange(3, 49152) for _ in range(rng.randrange(8, 24))]
            words = passage + words[:5] + passage
        result.append(words)
    return result


def request(prompt: list[int], sampling=None, **fields) -> router_pb2.RouterGenerateRequest:
    sampling = sampling or worker_pb2.ResolvedSamplingParams(top_p=1.0, repetition_penalty=1.0)
    return router_pb2.RouterGenerateRequest(prompt_token_ids=prompt, sampling=sampling,
                                            max_tokens=fields.pop("max_tokens", MAX_TOKENS), **fields)


async def generate(stub, message) -> tuple[list[int], router_pb2.RouterGenerateResponse]:
    tokens: list[int] = []
    last = None
    async for response in stub.Generate(message, timeout=TIMEOUT_S):
        tokens.extend(response.token_ids)
        last = response
    assert last is not None and last.usage.completion_tokens == len(tokens)
    return tokens, last


def run_router(stack: Stack, messages: list, alone: list | None = None):
    """Every message at once, then each of `alone` on its own; (outputs, last responses, stats)."""
    async def scenario():
        async with grpc.aio.insecure_channel(stack.router_address, options=CHANNEL_OPTIONS) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            batched = await asyncio.gather(*(generate(stub, m) for m in messages))
            single = [await generate(stub, m) for m in alone or []]
            stats = await stub.GetStats(router_pb2.GetStatsRequest(), timeout=TIMEOUT_S)
            return batched, single, stats
    return asyncio.run(scenario())


def run_gateway(stack: Stack, stops: list[list[str]]) -> list[tuple[str, int]]:
    with grpc.insecure_channel(stack.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        results = []
        for prompt, stop in zip(TEXT_PROMPTS, stops):
            text, finish = "", 0
            for response in stub.Generate(generation_pb2.GenerateRequest(
                prompt=prompt, max_tokens=MAX_TOKENS, stop=stop,
                sampling=generation_pb2.SamplingParams(temperature=0),
            ), timeout=TIMEOUT_S):
                text += response.text
                finish = response.finish_reason or finish
            results.append((text, finish))
        return results


def test_tp1_greedy_seeded_stops_and_usage_are_the_same_with_speculation(stack) -> None:
    greedy = [request(p) for p in prompts()]
    seeded = [request(p, SEEDED) for p in prompts()[:4]]
    stack.router(*SPEC_OFF)
    (off, off_seeded, off_stats) = run_router(stack, greedy + seeded, seeded)
    assert off_stats.num_draft_tokens == 0
    reference = [tokens for tokens, _ in off]
    # Stop ids and max_tokens chosen to fall inside the repeated runs speculation accepts.
    looping = [i for i, tokens in enumerate(reference) if len(set(tokens[4:])) < len(tokens[4:]) // 2]
    assert looping, "the tiny model was expected to repeat itself"
    cuts = [request(prompts()[i], stop_token_ids=[reference[i][7]]) for i in looping[:5]]
    cuts += [request(prompts()[i], max_tokens=9) for i in looping[:5]]
    full_texts = run_gateway(stack, [[] for _ in TEXT_PROMPTS])
    stops = [[text[len(text) // 2 : len(text) // 2 + 2]] if len(text) > 4 else [] for text, _ in full_texts]
    off_gateway = run_gateway(stack, stops)
    (off_cuts, _, _) = run_router(stack, cuts)

    stack.router(*SPEC_ON)
    (on, on_seeded, stats) = run_router(stack, greedy + seeded, seeded)
    assert [tokens for tokens, _ in on] == reference
    assert [tokens for tokens, _ in on_seeded] == [tokens for tokens, _ in off_seeded]
    assert [tokens for tokens, _ in on_seeded] == reference[NUM_PROMPTS:]  # alone == batched
    assert stats.num_accepted_draft_tokens > 0, "no draft was ever accepted"
    for tokens, last in on + on_seeded:
        usage = last.usage
        assert usage.completion_tokens == len(tokens)
        assert 0 <= usage.accepted_draft_tokens <= usage.draft_tokens
        assert usage.accepted_draft_tokens <= usage.completion_tokens - 1  # the first is the prefill's
    assert sum(last.usage.accepted_draft_tokens for _, last in on + on_seeded) == stats.num_accepted_draft_tokens
    assert sum(last.usage.draft_tokens for _, last in on + on_seeded) == stats.num_draft_tokens
    (on_cuts, _, _) = run_router(stack, cuts)
    assert [tokens for tokens, _ in on_cuts] == [tokens for tokens, _ in off_cuts]
    for (tokens, last), index in zip(on_cuts, looping[:5]):
        assert tokens == reference[index][: reference[index].index(reference[index][7]) + 1]
        assert last.finish_reason == generation_pb2.FINISH_REASON_STOP
    assert all(len(tokens) == 9 for tokens, _ in on_cuts[len(on_cuts) // 2:])
    on_gateway = run_gateway(stack, stops)
    assert on_gateway == off_gateway
    for (text, finish), (full, _), stop in zip(on_gateway, full_texts, stops):
        if stop:
            assert text == full[: full.index(stop[0])] and finish == generation_pb2.FINISH_REASON_STOP

    stack.router(*SPEC_ON, "--max-pages", str(SMALL_POOL_PAGES))
    (small, _, small_stats) = run_router(stack, greedy)
    assert [tokens for tokens, _ in small] == reference[:NUM_PROMPTS]
    assert small_stats.num_retractions > 0 and small_stats.num_accepted_draft_tokens > 0


def test_cancelling_a_speculating_request_gives_every_page_back(stack) -> None:
    stack.router(*SPEC_ON)
    passage = list(range(1000, 1016))
    message = request(passage * 3, max_tokens=400)

    async def scenario():
        async with grpc.aio.insecure_channel(stack.router_address, options=CHANNEL_OPTIONS) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            call = stub.Generate(message, timeout=TIMEOUT_S)
            num_tokens = 0
            async for response in call:
                num_tokens += len(response.token_ids)
                if num_tokens >= 20:
                    break
            call.cancel()
            for _ in range(200):
                stats = await stub.GetStats(router_pb2.GetStatsRequest(), timeout=TIMEOUT_S)
                if stats.num_running == 0:
                    return stats
                await asyncio.sleep(0.05)
            raise AssertionError("the cancelled request is still running")

    stats = asyncio.run(scenario())
    assert stats.num_draft_tokens > 0
    assert stats.num_pages_used == stats.num_pages_evictable  # only the cache holds pages


def test_speculation_with_overlap_scheduling_gives_the_same_greedy_output(stack) -> None:
    """Steps that verify drafts are never run ahead of (overlap waits for their result), the
    others are: both kinds interleave, and the output is still that of plain decoding."""
    greedy = [request(p) for p in prompts()]
    stack.router(*SPEC_OFF)
    (off, _, _) = run_router(stack, greedy)
    stack.router(*SPEC_ON, "--overlap")
    (on, _, stats) = run_router(stack, greedy)
    assert [tokens for tokens, _ in on] == [tokens for tokens, _ in off]
    assert stats.num_accepted_draft_tokens > 0
