"""Structured output through the whole stack (`radixserve up` with a tiny random model that has
SmolLM2's tokenizer): JSON-schema outputs validate, unconstrained neighbours are unchanged,
max_tokens gives LENGTH and stop strings still apply, invalid constraints are INVALID_ARGUMENT
within 1 s, a pathological regex holds up nobody, and TP=2 gives TP=1's constrained output."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest

from constrained_model import make_constrained_model
from e2e.stack import launch
from procs import ServiceProcesses
from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"], "additionalProperties": False,
}
INVALID = {
    "schema not JSON": pb.Constraint(json_schema="{not json"),
    "schema bad type": pb.Constraint(json_schema='{"type": "nope"}'),
    "regex": pb.Constraint(regex="(*unclosed"),
    "grammar": pb.Constraint(grammar="start: undefined_rule"),
    "no choices": pb.Constraint(choice=pb.Choices()),
}
# A regex whose lexer would need an enormous number of states: llguidance stops on its fuel.
PATHOLOGICAL = "(.{1,1000}){1,1000}"
TIMEOUT_S = 60
ANSWER_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    return make_constrained_model(tmp_path_factory.mktemp("constrained"), smollm2_dir)


@pytest.fixture(scope="module")
def stack(model_dir):
    with ServiceProcesses() as procs:
        yield launch(procs, model_dir, tp=1, default_max_tokens=96)


def generate(address: str, **fields) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        return list(stub.Generate(pb.GenerateRequest(**fields), timeout=TIMEOUT_S))


def output(responses: list[pb.GenerateResponse]) -> tuple[str, list[int], int]:
    text = "".join(r.text for r in responses)
    return text, [t for r in responses for t in r.token_ids], responses[-1].finish_reason


def greedy(**fields) -> dict:
    return dict(sampling=pb.SamplingParams(temperature=0), **fields)


@pytest.mark.timeout(180)
def test_json_schema_outputs_validate_and_neighbours_are_unchanged(stack) -> None:
    schema = pb.Constraint(json_schema=json.dumps(SCHEMA))
    plain = greedy(prompt="Tell me about yourself.", max_tokens=24)
    [alone] = [output(generate(stack.gateway, **plain))]
    with ThreadPoolExecutor(max_workers=9) as pool:
        constrained = [
            pool.submit(generate, stack.gateway, prompt="Describe a person as JSON.", constraint=schema,
                        sampling=pb.SamplingParams(temperature=1.0))
            for _ in range(8)
        ]
        time.sleep(0.2)  # the constrained requests are running when the plain one joins them
        mixed = output(pool.submit(generate, stack.gateway, **plain).result())
        texts = [output(future.result()) for future in constrained]
    assert mixed == alone
    for text, _, finish in texts:
        assert finish == pb.FINISH_REASON_STOP, text
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.timeout(120)
def test_max_tokens_is_length_and_stop_strings_still_apply(stack) -> None:
    schema = pb.Constraint(json_schema=json.dumps(SCHEMA))
    text, ids, finish = output(generate(stack.gateway, **greedy(prompt="JSON:", constraint=schema, max_tokens=3)))
    assert finish == pb.FINISH_REASON_LENGTH and len(ids) == 3 and text.startswith('{"name":')
    choice = pb.Constraint(choice=pb.Choices(choices=["alpha beta gamma"]))
    text, _, finish = output(generate(stack.gateway, **greedy(prompt="Say:", constraint=choice, stop=[" gamma"])))
    assert (text, finish) == ("alpha beta", pb.FINISH_REASON_STOP)
    regex = pb.Constraint(regex="[0-9]{3}-[a-z]{2}")
    text, _, finish = output(generate(stack.gateway, prompt="Code:", constraint=regex,
                                      sampling=pb.SamplingParams(temperature=1.0, seed=5)))
    assert finish == pb.FINISH_REASON_STOP and len(text) == 6 and text[3] == "-"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_constraint_is_invalid_argument_within_a_second(stack, case) -> None:
    generate(stack.gateway, prompt="warm", max_tokens=1)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        generate(stack.gateway, prompt="Answer:", constraint=INVALID[case], max_tokens=8)
    assert time.monotonic() - start < ANSWER_WITHIN_S
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "constraint" in caught.value.details()


@pytest.mark.timeout(120)
def test_pathological_regex_is_bounded_and_stalls_nobody(stack) -> None:
    plain = greedy(prompt="Count with me:", max_tokens=40, ignore_eos=True)
    expected = output(generate(stack.gateway, **plain))
    result: dict = {}
    streaming = threading.Thread(target=lambda: result.update(out=output(generate(stack.gateway, **plain))))
    streaming.start()
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        generate(stack.gateway, prompt="x", constraint=pb.Constraint(regex=PATHOLOGICAL), max_tokens=8)
    assert time.monotonic() - start < ANSWER_WITHIN_S
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    streaming.join(TIMEOUT_S)
    assert result["out"] == expected


@pytest.mark.timeout(300)
def test_tp2_gives_the_constrained_output_of_tp1(stack, model_dir) -> None:
    requests = [
        greedy(prompt="Describe a person as JSON.", constraint=pb.Constraint(json_schema=json.dumps(SCHEMA))),
        greedy(prompt="Code:", constraint=pb.Constraint(regex="[A-Z]{2}-[0-9]{4}")),
        greedy(prompt="Pick one:", constraint=pb.Constraint(choice=pb.Choices(choices=["red", "green", "blue"]))),
        greedy(prompt="Any JSON object:", constraint=pb.Constraint(json_object=True), max_tokens=24),
    ]
    tp1 = [output(generate(stack.gateway, **fields)) for fields in requests]
    with ServiceProcesses() as procs:
        tp2_stack = launch(procs, model_dir, tp=2, default_max_tokens=96)
        tp2 = [output(generate(tp2_stack.gateway, **fields)) for fields in requests]
    assert tp2 == tp1
    jsonschema.validate(json.loads(tp1[0][0]), SCHEMA)
    assert tp1[2][0] in ("red", "green", "blue")
