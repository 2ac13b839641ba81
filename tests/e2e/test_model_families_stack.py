"""A new family through the whole stack: `radixserve up --replicas 2` with a tiny random Qwen3
that speaks SmolLM2's vocabulary (its tokenizer and chat template copied in), greedy chats equal
to transformers' token for token — one of them stopped by the last of the generation config's
`eos_token_id`s, an ordinary token the model emits a few tokens in — and a repeated chat served
from the radix cache; each of the two replicas' routers answers the same prompts with the same
tokens (two replicas serve what one does); and `radixserve up` refusing an architecture it does
not have, in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest

from constrained_model import SMOLLM2_VOCAB_SIZE, with_smollm2_tokenizer
from e2e.parity import check_greedy_parity
from e2e.reference import CHATS, MAX_NEW_TOKENS, greedy_references
from e2e.stack import free_port_block, launch
from procs import ServiceProcesses
from radixserve.stack_plan import ROUTER_PORT_OFFSET
from radixserve.v1 import router_pb2, router_pb2_grpc, worker_pb2
from radixserve_client import Client
from worker.families import make_family


STOPPED_CHAT = 2  # the chat that the added end-of-turn id stops
STOP_AFTER = 3  # tokens of it before that id
NUM_REPLICAS = 2


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, smollm2_dir):
    out_dir = make_family("qwen3", tmp_path_factory.mktemp("qwen3-stack"), vocab_size=SMOLLM2_VOCAB_SIZE)
    return with_smollm2_tokenizer(out_dir, smollm2_dir)


@pytest.fixture(scope="module")
def stop_id(qwen3_dir) -> int:
    """Appended to generation_config.json's `eos_token_id`s: the first token of one chat's greedy
    output, from its `STOP_AFTER`-th on, that it has not emitted before."""
    output = greedy_references(qwen3_dir)[STOPPED_CHAT].output_ids
    token_id = next(t for i, t in enumerate(output) if i >= STOP_AFTER and t not in output[:i])
    path = qwen3_dir / "generation_config.json"
    config = json.loads(path.read_text())
    assert token_id not in config["eos_token_id"]
    config["eos_token_id"] = [*config["eos_token_id"], token_id]
    path.write_text(json.dumps(config))
    return token_id


@pytest.fixture(scope="module")
def qwen3_references(qwen3_dir, stop_id):
    return greedy_references(qwen3_dir)


@pytest.fixture(scope="module")
def stack(qwen3_dir, stop_id):
    with ServiceProcesses() as procs:
        yield launch(procs, qwen3_dir, tp=1, default_max_tokens=MAX_NEW_TOKENS, replicas=NUM_REPLICAS)


@pytest.mark.timeout(300)
def test_qwen3_chats_match_transformers_and_a_repeat_hits_the_cache(stack, qwen3_references, stop_id) -> None:
    stopped = qwen3_references[STOPPED_CHAT]
    assert stopped.output_ids[-1] == stop_id and stopped.finished_by_eos
    assert STOP_AFTER < len(stopped.output_ids) < MAX_NEW_TOKENS
    for index, reference in enumerate(qwen3_references):
        check_greedy_parity(stack.gateway, index, reference)
    with Client(stack.gateway) as client:
        again = client.generate(messages=CHATS[1], max_tokens=MAX_NEW_TOKENS, temperature=0, timeout=60)
    assert again.token_ids == qwen3_references[1].output_ids
    assert 0 < again.usage.cached_tokens < again.usage.prompt_tokens


@pytest.mark.timeout(300)
def test_each_replica_serves_the_greedy_outputs_of_one(stack, qwen3_references) -> None:
    metadata = stack.internal_metadata()
    for replica in range(NUM_REPLICAS):
        address = f"127.0.0.1:{stack.port + ROUTER_PORT_OFFSET + replica}"
        with grpc.insecure_channel(address) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            for reference in qwen3_references:
                request = router_pb2.RouterGenerateRequest(
                    request_id=f"replica{replica}", prompt_token_ids=reference.prompt_ids,
                    max_tokens=len(reference.output_ids),
                    sampling=worker_pb2.ResolvedSamplingParams(top_p=1.0, repetition_penalty=1.0))
                tokens = [t for r in stub.Generate(request, timeout=60, metadata=metadata) for t in r.token_ids]
                assert tokens == reference.output_ids, (address, reference.text)


@pytest.mark.timeout(300)
def test_up_with_an_unsupported_architecture_names_it_in_one_line(tmp_path) -> None:
    model_dir = make_family("qwen3", tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["NoSuchForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    result = subprocess.run(
        [sys.executable, "-m", "radixserve.launcher", "up", "--model", str(model_dir), "--tp", "1",
         "--port", str(free_port_block(1)), "--device", "cpu", "--kv-cache-mb", "16"],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    lines = [line for line in output.splitlines() if "unsupported architecture ['NoSuchForCausalLM']" in line]
    assert len(lines) == 1 and "'Qwen3ForCausalLM'" in lines[0] and "'Gemma3ForCausalLM'" in lines[0], output[-3000:]
    assert "Traceback" not in output
    assert "started worker0" not in output  # refused before anything started
