"""Constrained decoding on rank 0: outputs sampled at temperature 1.0 from a random model all
satisfy their JSON schema, regex or choice; greedy is deterministic; unconstrained rows of a
mixed batch are untouched; a resumed request's matcher replays its output; EOS comes exactly
when the constraint is complete; logprobs are of the constrained distribution.

The model is a tiny random Llama with SmolLM2's tokenizer (tests/constrained_model.py): its
samples wander over the whole vocabulary, so only the masks keep them valid. Every output of a
test comes from one batched run through the executor.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import jsonschema
import pytest
from transformers import AutoTokenizer

from constrained_model import make_constrained_model
from radixserve.constraints import Constraint, ConstraintKind
from radixserve.grammar_compiler import JSON_OPTIONS
from radixserve.sampling import SamplingParams
from worker.executor_fakes import entry, error_of, new_request, task
from worker_service.executor import Executor
from worker_service.grammar import ConstraintMasks
from worker_service.model_runner import ModelRunner, RunnerConfig
from worker_service.sampling import Sampler

SAMPLES = 50
MAX_TOKENS = 160
EOS = 2
KV_CACHE_BYTES = 64 << 20
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False,
            },
        },
        "required": ["name", "address"], "additionalProperties": False,
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
            "level": {"enum": ["low", "high", 3]},
        },
        "required": ["tags", "level"], "additionalProperties": False,
    },
    "ranges": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "ok": {"type": "boolean"},
        },
        "required": ["age", "score", "ok"], "additionalProperties": False,
    },
    "list_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}, "v": {"type": ["string", "null"], "maxLength": 3}},
            "required": ["id"], "additionalProperties": False,
        },
        "maxItems": 3,
    },
}
REGEX = r"[A-Z][a-z]{1,5}-[0-9]{2,3}(\.[0-9])?"
CHOICES = ("yes", "no", "maybe later", "Ωmega")


@dataclass
class Run:
    """One request's output; `finished` when it ended on EOS (not on max_tokens)."""

    token_ids: list[int]
    finished: bool
    logprobs: list[float]


class Generator:
    """A minimal router: prefills every request in one step, then decodes them together."""

    def __init__(self, executor: Executor, page_size: int) -> None:
        self.executor, self.page_size, self.task_id, self.next_id = executor, page_size, 0, 0

    def run(self, prompt: list[int], constraints: list[Constraint | None], sampling: list[SamplingParams],
            max_tokens: int = MAX_TOKENS) -> list[Run]:
        pages_each = (len(prompt) + max_tokens + self.page_size) // self.page_size
        ids = [f"q{self.next_id + i}" for i in range(len(constraints))]
        self.next_id += len(ids)
        entries = [
            entry(rid, prompt, 0, list(range(i * pages_each, (i + 1) * pages_each)), True,
                      new_request(params, [], len(prompt), constraint))
            for i, (rid, constraint, params) in enumerate(zip(ids, constraints, sampling))
        ]
        runs = {rid: Run([], False, []) for rid in ids}
        position = len(prompt)
        while entries:
            for token in self._execute(entries):
                run = runs[token.request_id]
                run.token_ids.append(token.token_id)
                run.logprobs.append(token.logprob if token.logprob is not None else math.nan)
                run.finished = token.token_id == EOS
            live = [rid for rid in ids if not runs[rid].finished and len(runs[rid].token_ids) < max_tokens]
            entries = [entry(rid, [runs[rid].token_ids[-1]], position, [], True) for rid in live]
            position += 1
        self._execute([], release=ids)
        return [runs[rid] for rid in ids]

    def _execute(self, entries: list, release: list[str] = ()):
        self.task_id += 1
        result = self.executor.execute(task(self.task_id, entries, release_request_ids=list(release)))
        assert error_of(result) is None, result.error
        return result.tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    return make_constrained_model(tmp_path_factory.mktemp("constrained"), smollm2_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def generator(model_dir) -> Generator:
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_bytes=KV_CACHE_BYTES))
    masks = ConstraintMasks.load(model_dir, runner.info.vocab_size, list(runner.info.eos_token_ids), 64, 1)
    assert masks is not None
    return Generator(Executor(runner, Sampler(seed=0), constraints=masks), runner.info.page_size)


def text_of(tokenizer, run: Run) -> str:
    assert run.finished, f"ended on max_tokens: {tokenizer.decode(run.token_ids)!r}"
    assert run.token_ids[-1] == EOS and EOS not in run.token_ids[:-1]
    return tokenizer.decode(run.token_ids[:-1])


@pytest.mark.timeout(240)
def test_sampled_outputs_satisfy_their_constraints(generator, tokenizer) -> None:
    constraints = [Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)) for schema in SCHEMAS.values()]
    constraints += [Constraint(ConstraintKind.REGEX, REGEX), Constraint(ConstraintKind.CHOICE, choices=CHOICES)]
    rows = [c for c in constraints for _ in range(SAMPLES)]
    prompt = tokenizer.encode("Answer:")
    runs = generator.run(prompt, rows, [SamplingParams(temperature=1.0)] * len(rows))
    texts = {c: [text_of(tokenizer, run) for run, row in zip(runs, rows) if row == c] for c in constraints}
    for schema, constraint in zip(SCHEMAS.values(), constraints):
        for text in texts[constraint]:
            jsonschema.validate(json.loads(text), schema)
        assert len(set(texts[constraint])) >= 5, "temperature 1.0 should give varied outputs"
    assert all(re.fullmatch(REGEX, text) for text in texts[constraints[-2]])
    outputs = texts[constraints[-1]]
    assert set(outputs) <= set(CHOICES) and len(set(outputs)) > 1


def test_llguidances_own_grammar_is_enforced_with_its_named_grammars(generator, tokenizer) -> None:
    """The `llguidance` kind (what the gateway sends for a constraint behind a reasoning block):
    a Lark start that refers to a JSON schema by name."""
    grammars = {"grammars": [{"name": "answer", "lark_grammar": 'start: "Level: " @ranges\n'},
                             {"name": "ranges", "json_schema": {**SCHEMAS["ranges"], "x-guidance": JSON_OPTIONS}}]}
    constraint = Constraint(ConstraintKind.LLGUIDANCE, json.dumps(grammars))
    assert not constraint.problems()
    runs = generator.run(tokenizer.encode("Answer:"), [constraint] * 8, [SamplingParams(temperature=1.0)] * 8)
    for run in runs:
        text = text_of(tokenizer, run)
        assert run.finished and text.startswith("Level: "), text
        jsonschema.validate(json.loads(text.removeprefix("Level: ")), SCHEMAS["ranges"])
    for text in ("not json", "[]", '{"grammars": []}', '{"grammar": [{}]}'):
        assert Constraint(ConstraintKind.LLGUIDANCE, text).problems() == [
            'constraint.llguidance must be a JSON object with a non-empty list "grammars"'], text


@pytest.mark.timeout(120)
def test_greedy_is_deterministic_and_unconstrained_rows_are_untouched(generator, tokenizer) -> None:
    prompt = tokenizer.encode("Hello")
    schema = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS["nested"]))
    greedy, seeded = SamplingParams(), SamplingParams(temperature=1.0, seed=7)
    alone = generator.run(prompt, [None, None], [greedy, seeded], max_tokens=16)
    mixed = generator.run(prompt, [schema, None, schema, None, schema], [greedy, greedy, greedy, seeded, seeded],
                          max_tokens=16)
    again = generator.run(prompt, [schema], [greedy], max_tokens=16)
    assert [mixed[1].token_ids, mixed[3].token_ids] == [alone[0].token_ids, alone[1].token_ids]
    assert mixed[0].token_ids == mixed[2].token_ids == again[0].token_ids
    assert mixed[0].token_ids != alone[0].token_ids  # the constraint changed the greedy path


@pytest.mark.timeout(120)
def test_eos_only_when_complete_and_max_tokens_cuts_short(generator, tokenizer) -> None:
    prompt = tokenizer.encode("Pick:")
    choice = Constraint(ConstraintKind.CHOICE, choices=("maybe later",))
    [done] = generator.run(prompt, [choice], [SamplingParams()])
    assert tokenizer.decode(done.token_ids) == "maybe later<|im_end|>"
    [cut] = generator.run(prompt, [choice], [SamplingParams()], max_tokens=1)
    assert not cut.finished and len(cut.token_ids) == 1


@pytest.mark.timeout(120)
def test_logprobs_are_of_the_constrained_distribution(generator, tokenizer) -> None:
    prompt = tokenizer.encode("Pick:")
    choice = Constraint(ConstraintKind.CHOICE, choices=("yes", "no"))
    params = SamplingParams(temperature=1.0, seed=3, logprobs=True)
    runs = generator.run(prompt, [choice] * 8, [params] * 8)
    for run in runs:
        # After the word only EOS is allowed: probability 1 under the constrained distribution.
        assert run.logprobs[-1] == pytest.approx(0.0, abs=1e-5)
        assert tokenizer.decode(run.token_ids[:-1]) in ("yes", "no")


@pytest.mark.timeout(120)
def test_resumed_request_replays_its_output_into_a_new_matcher(generator, tokenizer) -> None:
    """Retraction: the request is released after some tokens and comes back with its prompt and
    output as one prefill (its first tokens as a cached prefix); the output goes on as if it
    had never stopped."""
    prompt = tokenizer.encode("Answer:")
    schema = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS["nested"]))
    [whole] = generator.run(prompt, [schema], [SamplingParams()])
    split = 5
    first = whole.token_ids[:split]
    executor = generator.executor
    sequence = prompt + first
    table = list(range(0, (len(sequence) + MAX_TOKENS) // generator.page_size + 1))
    cached = len(prompt) + 2  # the prompt and two output tokens come from the prefix cache
    new = new_request(SamplingParams(), sequence[:cached], len(prompt), schema)
    generator.task_id += 1
    result = executor.execute(task(generator.task_id, [entry("resumed", sequence[cached:], cached, table, True, new)]))
    assert error_of(result) is None, result.error
    tokens = [result.tokens[0].token_id]
    while tokens[-1] != EOS:
        generator.task_id += 1
        step = entry("resumed", [tokens[-1]], len(sequence) + len(tokens) - 1, [], True)
        tokens.append(executor.execute(task(generator.task_id, [step])).tokens[0].token_id)
    generator.task_id += 1
    executor.execute(task(generator.task_id, [], release_request_ids=["resumed"]))
    assert first + tokens == whole.token_ids
