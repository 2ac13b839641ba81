"""The stack benchmark's fake worker group speaks the worker protocol as the router uses it:
tokens of real text at the entry's position, overlap references, drafts accepted while they
match, logprobs only when asked, releases and resets."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from bench.fake_worker_group import LOGPROB, TEXT, FakeWorkerGroup, text_token_ids
from radixserve.v1 import worker_pb2


def new_request(logprobs: bool) -> worker_pb2.NewRequest:
    return worker_pb2.NewRequest(sampling=worker_pb2.ResolvedSamplingParams(logprobs=logprobs), num_prompt_tokens=3)


def test_samples_the_paragraph_in_order_with_references_drafts_and_logprobs(smollm2_dir) -> None:
    token_ids, vocab_size, eos = text_token_ids(str(smollm2_dir))
    # The gateway detokenizes real text (with the same decoder, see gateway_service/tokenizer.py).
    assert Tokenizer.from_file(str(smollm2_dir / "tokenizer.json")).decode(token_ids) == TEXT
    assert vocab_size == 49152 and eos
    worker = FakeWorkerGroup(0.0, token_ids, vocab_size, eos)
    # Prefill of 3 prompt tokens for two requests: each samples the text's token at position 3.
    first = worker.run(worker_pb2.DecodeTask(task_id=1, reset=True, entries=[
        worker_pb2.TaskEntry(request_id="a", new_request=new_request(True), token_ids=[1, 2, 3], sample=True),
        worker_pb2.TaskEntry(request_id="b", new_request=new_request(False), token_ids=[1, 2, 3], sample=True),
    ]))
    assert [(t.request_id, t.token_id, t.logprob) for t in first.tokens] == [
        ("a", token_ids[3], LOGPROB), ("b", token_ids[3], 0.0)]
    # A decode that refers to the token in flight (overlap) computes position 3: samples 4.
    second = worker.run(worker_pb2.DecodeTask(task_id=2, entries=[
        worker_pb2.TaskEntry(request_id="a", start_position=3, sampled_in_task=1, sample=True)]))
    assert [t.token_id for t in second.tokens] == [token_ids[4]]
    # Drafts for positions 5.. are accepted while they match the text: two right, then a wrong one.
    drafts = [token_ids[5], token_ids[6], token_ids[7] + 1]
    third = worker.run(worker_pb2.DecodeTask(task_id=3, release_request_ids=["b"], entries=[
        worker_pb2.TaskEntry(request_id="a", start_position=4, token_ids=[token_ids[4], *drafts], sample=True,
                             num_draft_tokens=3)]))
    (sampled,) = third.tokens
    assert (sampled.num_accepted_drafts, sampled.token_id) == (2, token_ids[7])
    assert [(lp.token_id, lp.logprob) for lp in sampled.accepted_logprobs] == [(d, LOGPROB) for d in drafts[:2]]
    assert "b" not in worker.logprobs and worker.logprobs["a"]
    # An entry that does not sample answers nothing (a prefill chunk before the last).
    assert not worker.run(worker_pb2.DecodeTask(task_id=4, entries=[
        worker_pb2.TaskEntry(request_id="c", new_request=new_request(False), token_ids=[1, 2])])).tokens


def test_router_step_cost_runs_the_engine_with_overlap_over_the_fake(smollm2_dir) -> None:
    """`bench.router_step_cost` drives the real engine and a Stream call over the fake called in
    place: every stream decodes in every step (one token each, requests reopened as they end),
    with overlap on by the default for the fake's device; the tokens are counted whether the call
    sends them bare or as updates."""
    import asyncio

    from bench.router_step_cost import measure

    for bare_tokens in (True, False):
        us_per_step, tokens_per_step = asyncio.run(measure(8, 40, 16, str(smollm2_dir), bare_tokens))
        assert 7.0 <= tokens_per_step <= 8.0  # a request's first token comes from its prefill step
        assert us_per_step > 0


def test_gateway_token_cost_streams_every_request_through_the_servicer(smollm2_dir) -> None:
    """`bench.gateway_token_cost` runs GenerateMany's path over a Stream call answered in place:
    every open request gets a token in every step (first and last as updates, the rest bare),
    requests reopen as they end, and every token reaches the call's messages."""
    import argparse
    import asyncio

    from bench.gateway_token_cost import measure

    args = argparse.Namespace(streams=8, steps=40, max_tokens=16, model=str(smollm2_dir))
    us_per_token, us_per_step, tokens = asyncio.run(measure(args))
    assert tokens == 8 * 40  # one token per stream per measured step
    assert 0 < us_per_token and us_per_step == pytest.approx(us_per_token * 8)
