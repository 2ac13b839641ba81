"""Embedding requests on a rank: the executor over a real tiny model pools what transformers'
base model returns (`last_hidden_state`), last-token or mean, normalised or not, in one
prefill or in chunks, alone or in a step with generation entries."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

from radixserve import sampling
from radixserve.sampling import SamplingParams
from radixserve.v1 import worker_pb2
from worker.tiny_models import VOCAB_SIZE, make_tiny_llama
from worker_service.executor import Executor
from worker_service.model_runner import ModelRunner, RunnerConfig

PAGE_SIZE = 4
COSINE_TOLERANCE = 1e-4
LAST, MEAN = worker_pb2.POOLING_MODE_LAST, worker_pb2.POOLING_MODE_MEAN


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-embed"))


@pytest.fixture(scope="module")
def executor(model_dir) -> Executor:
    return Executor(ModelRunner(RunnerConfig(model_dir=model_dir, page_size=PAGE_SIZE, kv_cache_bytes=1 << 20)))


@pytest.fixture(scope="module")
def reference(model_dir):
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()

    def embed(token_ids: list[int], mode: int, normalize: bool) -> torch.Tensor:
        with torch.no_grad():
            hidden = model(torch.tensor([token_ids])).last_hidden_state[0]
        vector = hidden[-1] if mode == LAST else hidden.mean(dim=0)
        return torch.nn.functional.normalize(vector, dim=0) if normalize else vector

    return embed


def new(**fields) -> worker_pb2.NewRequest:
    return worker_pb2.NewRequest(sampling=sampling.to_proto(SamplingParams()), **fields)


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


class Pages:
    """Hands out page ids the way the router would (each id once per test)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, num_tokens: int) -> list[int]:
        count = (num_tokens + PAGE_SIZE - 1) // PAGE_SIZE
        self.next += count
        return list(range(self.next - count, self.next))


def run(executor: Executor, task: worker_pb2.DecodeTask) -> worker_pb2.TaskResult:
    result = executor.execute(task)
    assert not result.HasField("error"), result.error
    return result


def assert_same(vector, expected: torch.Tensor, normalize: bool) -> None:
    got = torch.tensor(list(vector))
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=0).item()
    assert cosine >= 1 - COSINE_TOLERANCE
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    if normalize:
        assert got.norm().item() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("mode", [LAST, MEAN])
@pytest.mark.parametrize("normalize", [True, False])
def test_one_prefill_matches_transformers(executor, reference, mode, normalize) -> None:
    token_ids = prompt(mode * 10 + normalize, 13)
    pages = Pages()
    task = worker_pb2.DecodeTask(task_id=1, reset=True)
    task.entries.add(request_id="e", token_ids=token_ids, page_ids=pages.take(13), sample=True,
                     new_request=new(num_prompt_tokens=13,
                                                       pooling=worker_pb2.Pooling(mode=mode, normalize=normalize)))
    result = run(executor, task)
    assert [token.request_id for token in result.tokens] == ["e"]
    assert_same(result.tokens[0].embedding, reference(token_ids, mode, normalize), normalize)


def test_chunked_and_batched_with_generation(executor, reference) -> None:
    """Two embedding requests in chunks, sharing steps with a generating request; the sampled
    tokens come back in entry order, embeddings only on the chunk that ends the prompt. A
    last-token request may start after a cached prefix (here: the first 8 tokens)."""
    mean_ids, last_ids, gen_ids = prompt(1, 11), prompt(2, 14), prompt(3, 6)
    pages = Pages()
    mean_pages, last_pages, gen_pages = pages.take(11), pages.take(14), pages.take(8)
    # The last-token request's first 8 positions come from another request's pages (a cache hit).
    warm = worker_pb2.DecodeTask(task_id=1, reset=True)
    warm.entries.add(request_id="warm", token_ids=last_ids[:8], page_ids=last_pages[:2], sample=False,
                     new_request=new(num_prompt_tokens=8))
    run(executor, warm)
    first = worker_pb2.DecodeTask(task_id=2, release_request_ids=["warm"])
    first.entries.add(request_id="gen", token_ids=gen_ids, page_ids=gen_pages, sample=True,
                      new_request=new(num_prompt_tokens=6))
    first.entries.add(request_id="mean", token_ids=mean_ids[:5], page_ids=mean_pages[:2], sample=False,
                      new_request=new(num_prompt_tokens=11, pooling=worker_pb2.Pooling(mode=MEAN)))
    first.entries.add(request_id="last", token_ids=last_ids[8:10], start_position=8, page_ids=last_pages,
                      sample=False, new_request=new(
                          num_prompt_tokens=14, cached_token_ids=last_ids[:8],
                          pooling=worker_pb2.Pooling(mode=LAST, normalize=True)))
    result = run(executor, first)
    assert [token.request_id for token in result.tokens] == ["gen"]
    token = result.tokens[0].token_id
    second = worker_pb2.DecodeTask(task_id=3)
    second.entries.add(request_id="mean", token_ids=mean_ids[5:], start_position=5, page_ids=mean_pages[2:],
                       sample=True)
    second.entries.add(request_id="gen", token_ids=[token], start_position=6, sample=True)
    second.entries.add(request_id="last", token_ids=last_ids[10:], start_position=10, sample=True)
    result = run(executor, second)
    assert [token.request_id for token in result.tokens] == ["mean", "gen", "last"]
    assert not result.tokens[1].embedding
    assert_same(result.tokens[0].embedding, reference(mean_ids, MEAN, False), False)
    assert_same(result.tokens[2].embedding, reference(last_ids, LAST, True), True)


def test_mean_pooling_refuses_a_cached_prefix(executor) -> None:
    task = worker_pb2.DecodeTask(task_id=1, reset=True)
    task.entries.add(request_id="m", token_ids=[5, 6], start_position=2, page_ids=[0], sample=True,
                     new_request=new(num_prompt_tokens=4, cached_token_ids=[3, 4],
                                                       pooling=worker_pb2.Pooling(mode=MEAN)))
    result = executor.execute(task)
    assert result.error.code == 3 and "mean pooling" in result.error.message
