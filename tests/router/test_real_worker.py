"""Prefix reuse with the real worker and the default model: cached tokens are not recomputed
(the router reports them cached) and what is computed on top of them is transformers' greedy
output. How much faster a cached prefix is belongs to the benchmarks (the shared-prefix workload of
bench/workloads.py), not to a timed assertion here."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch

from procs import PYTHON, ServiceProcesses, free_port
from radixserve.serving import CHANNEL_OPTIONS
from radixserve.v1 import router_pb2_grpc
from router.harness import generate_request

PREFIX_LEN = 500
# Enough KV for a few 500-token requests without loading the machine with the 1 GiB default.
KV_CACHE_MB = 96
MAX_TOKENS = 4
NUM_PAIRS = 2
# A generated token counts as greedy when its reference logit is this close to the maximum.
LOGIT_TOLERANCE = 1e-3


async def generate(stub, prompt: list[int]) -> tuple[list[int], object]:
    """The tokens and the last response of a greedy request."""
    tokens: list[int] = []
    last = None
    async for response in stub.Generate(generate_request(prompt, MAX_TOKENS), timeout=300):
        tokens.extend(response.token_ids)
        last = response
    return tokens, last


@pytest.mark.timeout(300)
def test_shared_500_token_prefix_is_served_from_cache(smollm2_dir) -> None:
    worker_port, router_port = free_port(), free_port()
    worker_address, router_address = f"127.0.0.1:{worker_port}", f"127.0.0.1:{router_port}"
    rng = random.Random(5)

    def fresh(num_tokens: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(num_tokens)]

    # Pairs of (cold request, warm request sharing its 500-token prefix).
    cold_prompts = [fresh(PREFIX_LEN) + fresh(12) for _ in range(NUM_PAIRS)]
    warm_prompts = [prompt[:PREFIX_LEN] + fresh(12) for prompt in cold_prompts]
    with ServiceProcesses() as procs:
        procs.start("worker", [
            PYTHON, "-m", "worker_service", "--model", str(smollm2_dir), "--port", str(worker_port),
            "--device", "cpu", "--dtype", "float32", "--kv-cache-mb", str(KV_CACHE_MB), "--log-level", "WARNING",
        ])
        procs.wait_healthy(worker_address, timeout_s=180)
        procs.start("router", [
            PYTHON, "-m", "router_service", "--port", str(router_port), "--workers", worker_address,
            "--log-level", "WARNING",
        ])
        procs.wait_healthy(router_address, timeout_s=60)

        async def scenario():
            async with grpc.aio.insecure_channel(router_address, options=CHANNEL_OPTIONS) as channel:
                stub = router_pb2_grpc.RouterServiceStub(channel)
                pairs = []
                for cold_prompt, warm_prompt in zip(cold_prompts, warm_prompts):
                    cold = await generate(stub, cold_prompt)
                    warm = await generate(stub, warm_prompt)
                    pairs.append((cold, warm))
                return pairs

        pairs = asyncio.run(scenario())

    for warm_prompt, ((_, cold_last), (_, warm_last)) in zip(warm_prompts, pairs):
        assert cold_last.usage.cached_tokens < 16
        assert warm_last.usage.cached_tokens >= 480
        assert warm_last.usage.prompt_tokens == len(warm_prompt)
    second_prompt, (_, (second_tokens, _)) = warm_prompts[0], pairs[0]
    # The tokens computed on top of cached pages are greedy under transformers' own logits.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    sequence = torch.tensor([second_prompt + second_tokens])
    with torch.no_grad():
        logits = model(sequence).logits[0, len(second_prompt) - 1 : -1]
    for step, token in enumerate(second_tokens):
        assert logits[step, token] >= logits[step].max() - LOGIT_TOLERANCE, step
