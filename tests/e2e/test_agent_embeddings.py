"""/v1/embeddings and Embed through a whole stack (the agent tests' `radixserve up`, TP=1, HTTP on)
with the official openai client: a tiny random Llama with SmolLM2's tokenizer whose folder
declares sentence-transformers mean pooling and normalisation (conftest.py). Vectors are held to transformers' base
model with the same pooling, alone, batched, as token ids, and while generations run beside
them in the same steps."""

from __future__ import annotations

import base64
import json
import re
import struct
import threading
from pathlib import Path

import grpc
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from e2e.agent_model import AGENT_MODEL
from e2e.metrics_scrape import scrape, total
from e2e.stack import LaunchedStack
from radixserve.v1 import generation_pb2, generation_pb2_grpc
from radixserve_client import Client, InvalidArgumentError

MODEL = AGENT_MODEL
TIMEOUT_S = 60.0
COSINE_TOLERANCE = 1e-4
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings are pooled hidden states.",
         "Paris", "A longer input, so that the batch mixes lengths: " + "words " * 30]


@pytest.fixture(scope="module")
def stack(agent_stack: LaunchedStack) -> LaunchedStack:
    return agent_stack


@pytest.fixture(scope="module")
def model_dir(stack: LaunchedStack) -> Path:
    return Path(re.search(r"--model (\S+)", " ".join(stack.launcher.args))[1])


@pytest.fixture(scope="module")
def api(agent_api: openai.OpenAI) -> openai.OpenAI:
    return agent_api


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' base model, mean-pooled and normalised, as sentence-transformers would."""
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def embed(item: str | list[int]) -> torch.Tensor:
        ids = tokenizer(item).input_ids if isinstance(item, str) else item
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden.mean(dim=0), dim=0)

    return embed


def assert_matches(vector: list[float], expected: torch.Tensor) -> None:
    got = torch.tensor(vector)
    assert got.shape == expected.shape
    assert torch.nn.functional.cosine_similarity(got, expected, dim=0).item() >= 1 - COSINE_TOLERANCE


@pytest.mark.timeout(180)
def test_batched_and_alone_match_transformers(api, reference) -> None:
    batched = api.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64
    assert [item.index for item in batched.data] == list(range(len(TEXTS)))
    for text, item in zip(TEXTS, batched.data):
        assert_matches(item.embedding, reference(text))
    alone = api.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    torch.testing.assert_close(torch.tensor(alone.data[0].embedding), torch.tensor(batched.data[1].embedding),
                               atol=1e-5, rtol=0)
    assert alone.usage.prompt_tokens == alone.usage.total_tokens > 0


@pytest.mark.timeout(180)
def test_token_ids_dimensions_and_base64(api, reference, stack) -> None:
    ids = [[17, 450, 2201, 33], [9, 8, 7]]
    one = api.embeddings.create(model=MODEL, input=ids[0], dimensions=64)
    assert_matches(one.data[0].embedding, reference(ids[0]))
    both = api.embeddings.create(model=MODEL, input=ids)
    assert_matches(both.data[1].embedding, reference(ids[1]))
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        api.embeddings.create(model=MODEL, input="x", dimensions=32)
    with pytest.raises(openai.BadRequestError, match="inputs\\[0\\]"):
        api.embeddings.create(model=MODEL, input=[[10**6]])
    # base64 is the float32 values' little-endian bytes.
    raw = api.with_raw_response.embeddings.create(model=MODEL, input="Paris", encoding_format="base64")
    encoded = json.loads(raw.http_response.text)["data"][0]["embedding"]
    values = struct.unpack(f"<{len(base64.b64decode(encoded)) // 4}f", base64.b64decode(encoded))
    assert_matches(list(values), reference("Paris"))


@pytest.mark.timeout(240)
def test_unaffected_by_generation_in_the_same_steps(api, reference, stack) -> None:
    """Embeddings asked while streamed generations run: same vectors; the generations finish."""
    finished: list[str] = []
    errors: list[BaseException] = []

    def generate(seed: int) -> None:
        try:
            for _ in range(2):
                stream = api.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Tell me a story {seed}"}],
                    max_tokens=24, temperature=1.0, seed=seed, stream=True)
                reasons = [chunk.choices[0].finish_reason for chunk in stream if chunk.choices]
                finished.append(reasons[-1])
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=generate, args=(seed,)) for seed in range(3)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(3):
            reply = api.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
            for text, item in zip(TEXTS, reply.data):
                assert_matches(item.embedding, reference(text))
    finally:
        for thread in threads:
            thread.join(timeout=TIMEOUT_S)
    assert not errors, errors
    assert finished == ["length"] * 6 or set(finished) <= {"length", "stop"} and len(finished) == 6


@pytest.mark.timeout(120)
def test_grpc_embed(stack, reference) -> None:
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        reply = stub.Embed(generation_pb2.EmbedRequest(inputs=[
            generation_pb2.EmbedInput(text=TEXTS[0]),
            generation_pb2.EmbedInput(tokens=generation_pb2.TokenIds(token_ids=[5, 6, 7])),
        ]), timeout=TIMEOUT_S)
        assert_matches(list(reply.embeddings[0].values), reference(TEXTS[0]))
        assert_matches(list(reply.embeddings[1].values), reference([5, 6, 7]))
        with pytest.raises(grpc.RpcError) as failure:
            stub.Embed(generation_pb2.EmbedRequest(), timeout=TIMEOUT_S)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs" in failure.value.details()
    # The Python client's embed: the same vectors, one input or several.
    with Client(stack.gateway) as client:
        assert client.embed(TEXTS[0], timeout=TIMEOUT_S) == [list(reply.embeddings[0].values)]
        assert client.embed([TEXTS[0], [5, 6, 7]], timeout=TIMEOUT_S) == [list(e.values) for e in reply.embeddings]
        with pytest.raises(InvalidArgumentError):
            client.embed([], timeout=TIMEOUT_S)


@pytest.mark.timeout(120)
def test_embedding_requests_are_counted_and_logged(api, stack) -> None:
    """requests_total and prompt_tokens_total count Embed and /v1/embeddings as they count
    generation (a refusal too), and each request gets its access-log line."""
    requests, prompt = "radixserve:requests_total", "radixserve:prompt_tokens_total"
    before = scrape(stack.metrics_url("gateway"))
    done = api.embeddings.create(model=MODEL, input=TEXTS[:2])
    with pytest.raises(openai.NotFoundError):
        api.embeddings.create(model="no-such-model", input="x")
    with grpc.insecure_channel(stack.gateway) as channel:
        generation_pb2_grpc.GenerationServiceStub(channel).Embed(generation_pb2.EmbedRequest(
            inputs=[generation_pb2.EmbedInput(tokens=generation_pb2.TokenIds(token_ids=[5, 6, 7]))]),
            timeout=TIMEOUT_S, metadata=(("x-request-id", "embed-req-1"),))
    after = scrape(stack.metrics_url("gateway"))

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta(requests, api="embeddings", status="ok", finish_reason="") == 1
    assert delta(requests, api="embeddings", status="NOT_FOUND") == 1
    assert delta(requests, api="grpc_embed", status="ok") == 1
    assert delta(prompt, api="embeddings") == done.usage.prompt_tokens
    assert delta(prompt, api="grpc_embed") == 3
    assert any(re.search(r"request embed-req-1 /radixserve.v1.GenerationService/Embed ok", line)
               for line in stack.output().splitlines())
