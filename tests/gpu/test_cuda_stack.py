"""The whole stack with its worker on CUDA (`radixserve up --device cuda`), in float32 and bfloat16:
the README's grpcurl call, and concurrent requests batched together (decode steps replayed from
CUDA graphs). In float32, greedy chats equal transformers' and each batched request gets the tokens
it gets alone (bfloat16's rounding differs between batch sizes, as every engine's does)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e.grpcurl_call import readme_generate
from e2e.parity import check_greedy_parity
from e2e.reference import CHATS, greedy_references
from e2e.stack import launch
from procs import ServiceProcesses
from radixserve_client import Client

NUM_CONCURRENT = 24


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def stack(request, smollm2_dir):
    with ServiceProcesses() as procs:
        launched = launch(procs, smollm2_dir, tp=1, device="cuda", dtype=request.param)
        launched.dtype = request.param
        yield launched


@pytest.mark.timeout(120)
def test_the_readme_grpcurl_call_streams_an_answer(stack) -> None:
    chunks = readme_generate(stack.gateway)
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    assert sum(len(c.get("token_ids", [])) for c in chunks) == 16


@pytest.mark.timeout(300)
def test_greedy_chats_equal_transformers_in_float32(stack, smollm2_dir) -> None:
    if stack.dtype != "float32":
        pytest.skip("greedy parity is a float32 check")
    for index, reference in enumerate(greedy_references(smollm2_dir)):
        check_greedy_parity(stack.gateway, index, reference)


@pytest.mark.timeout(300)
def test_concurrent_requests_get_the_tokens_each_gets_alone(stack) -> None:
    def ask(index: int) -> list[int]:
        with Client(stack.gateway) as client:
            return client.generate(messages=CHATS[index % len(CHATS)], max_tokens=24, temperature=0,
                                   ignore_eos=True, timeout=120).token_ids

    alone = [ask(index) for index in range(len(CHATS))]
    with ThreadPoolExecutor(NUM_CONCURRENT) as pool:
        together = list(pool.map(ask, range(NUM_CONCURRENT)))
    assert all(len(tokens) == 24 for tokens in together)
    if stack.dtype == "float32":
        assert together == [alone[index % len(CHATS)] for index in range(NUM_CONCURRENT)]
