"""Deterministic outputs through real processes (`--deterministic`): a request's tokens and
logprobs are the same bits whatever shares its steps and its cache.

One worker group per (TP size, dtype) of `GROUPS` serves a tiny random Llama; routers with different settings
take turns in front of it, each starting with an empty radix cache. 20 greedy and 20 seeded
sampled requests (half behind one long shared prefix) are sent:
- all at once to a fresh router (prefixes prefilled in the batch, cascade-shareable decode rows),
- some alone, one after another (the shared prefix now from the cache; 8 of the 40, greedy and
  sampled, with and without the shared prefix: each alone costs all its steps, and what the
  others' results add, a batch of one, is the same),
- all at once again (everything cached),
- all at once to a router with a pool small enough to retract and resume them, with speculation
  (drafts in a full batch) and overlap scheduling on;
and every run must equal the first, token for token and logprob for logprob. Speculation and
overlap are turned on together, with retraction: each alone is also covered by the other
module's tests (tests/e2e/test_speculative.py: outputs equal with speculation on and off), and a
difference here fails the comparison whichever of the three caused it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import grpc
import pytest

from procs import PYTHON, ServiceProcesses, free_port
from radixserve.serving import CHANNEL_OPTIONS
from radixserve.v1 import router_pb2, router_pb2_grpc, worker_pb2
from worker.tiny_models import VOCAB_SIZE, make_tiny_llama

NUM_EACH = 20  # greedy requests, and as many seeded sampled ones
MAX_TOKENS = 24  # more than a page: running requests outgrow the one page of headroom each gets
SHARED_PREFIX_LEN = 100  # six whole pages of 16 and a partial one
SMALL_POOL_PAGES = 12  # 40 requests of up to 10 pages each cannot all run at once: some retract
TIMEOUT_S = 120
# Requests also sent alone: greedy and seeded, each with and without the shared prefix, one with
# a repeated passage (drafts) of each kind.
ALONE = [0, 1, 2, 3, NUM_EACH, NUM_EACH + 1, NUM_EACH + 2, NUM_EACH + 3]
# Each dtype and each TP size once: the comparisons are bit for bit, so an order of summation
# that depends on the batch shows in either dtype; the kernels' own tests (test_invariance_kernels.py)
# cover both dtypes without processes. The other two pairs cost the suite ~50 s.
GROUPS = [(1, "bfloat16"), (2, "float32")]
FRESH = ["--no-speculative", "--no-overlap"]
CONTENDED = ["--max-pages", str(SMALL_POOL_PAGES), "--speculative", "--speculative-max-running", "64", "--overlap"]


def requests() -> list[router_pb2.RouterGenerateRequest]:
    rng = random.Random(35)
    shared = [rng.randrange(3, VOCAB_SIZE) for _ in range(SHARED_PREFIX_LEN)]
    result = []
    for index in range(2 * NUM_EACH):
        own = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(3, 16))]
        if index % 4 == 1:  # a repeated passage: n-gram drafts get accepted
            own = own + own
        prompt = shared + own if index % 2 else own
        if index < NUM_EACH:
            sampling = worker_pb2.ResolvedSamplingParams(top_p=1.0, repetition_penalty=1.0, logprobs=True)
        else:
            sampling = worker_pb2.ResolvedSamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.0,
                                                         has_seed=True, seed=1000 + index, logprobs=True)
        result.append(router_pb2.RouterGenerateRequest(prompt_token_ids=prompt, sampling=sampling,
                                                       max_tokens=MAX_TOKENS, ignore_eos=True))
    return result


async def generate(stub, message) -> tuple[list[int], list[float]]:
    tokens: list[int] = []
    logprobs: list[float] = []
    async for response in stub.Generate(message, timeout=TIMEOUT_S):
        tokens.extend(response.token_ids)
        logprobs.extend(entry.logprob for entry in response.logprobs)
    assert len(tokens) == MAX_TOKENS and len(logprobs) == MAX_TOKENS
    return tokens, logprobs


def run(address: str, messages, together: bool):
    """Outputs of `messages` (at once or one by one) and the router's stats after them."""
    async def scenario():
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            if together:
                outputs = await asyncio.gather(*(generate(stub, m) for m in messages))
            else:
                outputs = [await generate(stub, m) for m in messages]
            return list(outputs), await stub.GetStats(router_pb2.GetStatsRequest(), timeout=TIMEOUT_S)
    return asyncio.run(scenario())


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("det")))


@pytest.fixture(scope="module")
def procs() -> Iterator[ServiceProcesses]:
    with ServiceProcesses() as procs:
        yield procs


def start_group(procs: ServiceProcesses, model: str, tp: int, dtype: str) -> list[str]:
    for name in [n for n in procs.procs if n.startswith("worker") or n == "router"]:
        procs.stop(name)
        del procs.procs[name]  # stopped on purpose: not a process that died
    ports = [free_port() for _ in range(tp)]
    master_port = free_port()
    for rank, port in enumerate(ports):
        procs.start(f"worker{rank}-{tp}-{dtype}", [
            PYTHON, "-m", "worker_service", "--model", model, "--port", str(port), "--device", "cpu",
            "--dtype", dtype, "--deterministic", "--kv-cache-mb", "8", "--log-level", "WARNING",
            "--rank", str(rank), "--world-size", str(tp), "--master-port", str(master_port),
        ], env={"OMP_NUM_THREADS": "1"})
    addresses = [f"127.0.0.1:{port}" for port in ports]
    for address in addresses:
        procs.wait_healthy(address, timeout_s=TIMEOUT_S)
    return addresses


def start_router(procs: ServiceProcesses, workers: list[str], flags: list[str]) -> str:
    if "router" in procs.procs:
        procs.stop("router")
        del procs.procs["router"]
    port = free_port()
    procs.start("router", [PYTHON, "-m", "router_service", "--port", str(port), "--workers", ",".join(workers),
                           "--log-level", "WARNING", *flags])
    address = f"127.0.0.1:{port}"
    procs.wait_healthy(address, timeout_s=TIMEOUT_S)
    return address


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp, dtype", GROUPS, ids=[f"tp{tp}-{dtype}" for tp, dtype in GROUPS])
def test_outputs_are_bit_identical_whatever_shares_the_batch_or_the_cache(procs, tiny_llama, tp, dtype):
    started = time.monotonic()
    messages = requests()
    workers = start_group(procs, tiny_llama, tp, dtype)
    router = start_router(procs, workers, FRESH)
    first, _ = run(router, messages, together=True)
    assert len({tuple(tokens) for tokens, _ in first}) > NUM_EACH  # not one degenerate answer for all
    alone, _ = run(router, [messages[i] for i in ALONE], together=False)
    cached, stats = run(router, messages, together=True)
    assert stats.cache_hit_tokens > 0
    router = start_router(procs, workers, CONTENDED)
    contended, stats = run(router, messages, together=True)
    assert stats.num_retractions > 0 and stats.num_accepted_draft_tokens > 0
    for index, got in zip(ALONE, alone):
        assert got == first[index], f"request {index} alone: {got} != {first[index]} (first run)"
    for name, outputs in (("cached", cached), ("retracted, speculative, overlapped", contended)):
        for index, (expected, got) in enumerate(zip(first, outputs)):
            assert got == expected, f"request {index} {name}: {got} != {expected} (first run)"
    print(f"tp={tp} {dtype}: 4 runs of {len(messages)} requests identical in {time.monotonic() - started:.1f}s")
