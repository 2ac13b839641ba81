"""Harmony's constraints (`harmony_grammar`), compiled by llguidance against SmolLM2's tokenizer
with the harmony markers as special tokens: the analysis is free, then the final message's body
is what the constraint allows, or one call of a given tool with valid arguments; the markers are
their tokens, never their spelled text."""

from __future__ import annotations

import json

import pytest

from gateway_service import harmony
from gateway_service.harmony_grammar import harmony_answer, harmony_call_grammar
from radixserve.constraints import Constraint, ConstraintKind
from radixserve.grammar_compiler import GrammarCompiler
from radixserve.v1 import generation_pb2 as pb

THINK = "<|channel|>analysis<|message|>Hm, <b>{x}</b>.<|end|><|start|>assistant"
FINAL = "<|channel|>final<|message|>"
SCHEMA = {"type": "object", "properties": {"level": {"type": "integer"}}, "required": ["level"],
          "additionalProperties": False}
TOOLS = [pb.Tool(name="set_level", parameters=json.dumps(SCHEMA)), pb.Tool(name="now")]


def call(name: str, arguments: str) -> str:
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{arguments}"


@pytest.fixture(scope="module")
def vocabulary(smollm2_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    hf.add_special_tokens({"additional_special_tokens": list(harmony.MARKERS)})
    special = {marker: hf.convert_tokens_to_ids(marker) for marker in harmony.MARKERS}
    return hf, GrammarCompiler.from_hf(hf, cache_size=16, vocab_size=len(hf)), special


def _accepts(vocabulary, constraint: Constraint, text: str, spelled: bool = False) -> bool:
    hf, compiler, _ = vocabulary
    matcher = compiler.matcher(constraint)
    ids = hf.encode(text, add_special_tokens=False, split_special_tokens=spelled)
    return bool(matcher.consume_tokens(ids)) and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize("inner, good, bad", [
    (Constraint(ConstraintKind.JSON_SCHEMA, text=json.dumps(SCHEMA)), '{"level": 3}', '{"level": "3"}'),
    (Constraint(ConstraintKind.CHOICE, choices=("yes", "no")), "yes", "maybe"),
    (Constraint(ConstraintKind.REGEX, text="[A-Z][a-z]+"), "Paris", "paris"),
])
def test_the_final_message_is_bound_after_any_analysis(vocabulary, inner, good, bad) -> None:
    wrapped = harmony_answer(inner, vocabulary[2])
    for thinking in ("", THINK, THINK + THINK.replace("Hm", "So")):
        assert _accepts(vocabulary, wrapped, thinking + FINAL + good), thinking
        assert not _accepts(vocabulary, wrapped, thinking + FINAL + bad), thinking
    assert not _accepts(vocabulary, wrapped, good)  # the answer is the final message's body
    assert not _accepts(vocabulary, wrapped, THINK)  # not done
    assert not _accepts(vocabulary, wrapped, THINK + call("now", "{}"))
    assert not _accepts(vocabulary, wrapped, THINK + FINAL + good, spelled=True)


def test_a_required_call_is_one_valid_call_after_any_analysis(vocabulary) -> None:
    grammar = Constraint(ConstraintKind.GRAMMAR, text=harmony_call_grammar(TOOLS, vocabulary[2]))
    for thinking in ("", THINK):
        assert _accepts(vocabulary, grammar, thinking + call("set_level", '{"level": 3}'))
        assert _accepts(vocabulary, grammar, thinking + call("now", '{"any": [1]}'))
        assert not _accepts(vocabulary, grammar, thinking + call("set_level", '{"level": "high"}'))
        assert not _accepts(vocabulary, grammar, thinking + call("other", "{}"))
        assert not _accepts(vocabulary, grammar, thinking + FINAL + "Done.")
    assert not _accepts(vocabulary, grammar, THINK + call("set_level", '{"level": 3}'), spelled=True)
    named = Constraint(ConstraintKind.GRAMMAR, text=harmony_call_grammar(TOOLS[1:], vocabulary[2]))
    assert not _accepts(vocabulary, named, call("set_level", '{"level": 3}'))
