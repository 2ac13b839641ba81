"""The tool grammars of the tagged layouts (GLM-4.5, MiniMax-M2, Qwen3-Coder) and the marker-framed
sections (DeepSeek V3/V3.1, Kimi-K2), compiled by llguidance against SmolLM2's tokenizer twice:
as it is (every tag spelled as text) and with the family's tags added as special tokens (as the
released tokenizers have most of them). What the grammar lets a model write parses, with the
request's tools, into calls that validate against their schemas: random walks through the
grammar, and hand-written hostile values (a closing tag inside a value, a string that reads as a
number, a number that is not one)."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from gateway_service.chat_format import ChatFormat, plan_chat
from gateway_service.errors import InvalidRequest
from gateway_service.tokenizer import Tokenizer
from gateway_service.tool_call_stream import (
    DEEPSEEK_CALL_BEGIN,
    DEEPSEEK_CALL_END,
    DEEPSEEK_SEP,
    KIMI_ARGUMENTS,
    KIMI_CALL_BEGIN,
    KIMI_CALL_END,
)
from gateway_service.tool_grammar import tool_call_grammar
from gateway_service.tool_parsers import PARSERS
from radixserve.constraints import Constraint, ConstraintKind
from radixserve.grammar_compiler import GrammarCompiler
from radixserve.v1 import generation_pb2 as pb

TAGGED = ("glm45", "minimax_m2", "qwen3_coder")
SECTIONS = ("deepseek_v3", "deepseek_v31", "kimi_k2")
BOOKING = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "nights": {"type": "integer", "minimum": 1, "maximum": 14},
        "breakfast": {"type": "boolean"},
    },
    "required": ["city", "nights"],
    "additionalProperties": False,
}
NOTE = {"type": "object", "properties": {
    "text": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "code": {"type": "string", "pattern": "^[A-Z]{3}$"}, "essay": {"type": "string", "maxLength": 100_000}},
    "required": ["text"]}
PICK = {"type": "object", "properties": {"choice": {"enum": ["a", "b"]}}, "required": ["choice"],
        "additionalProperties": False}
TOOLS = [pb.Tool(name="book", parameters=json.dumps(BOOKING)), pb.Tool(name="note", parameters=json.dumps(NOTE)),
         pb.Tool(name="now")]
# Tools whose every call is bounded, so that a uniform walk ends.
BOUNDED = [TOOLS[0], pb.Tool(name="pick", parameters=json.dumps(PICK))]
SCHEMAS = {"book": BOOKING, "pick": PICK}
SECTION_TAGS = (DEEPSEEK_CALL_BEGIN, DEEPSEEK_SEP, DEEPSEEK_CALL_END, KIMI_CALL_BEGIN, KIMI_ARGUMENTS, KIMI_CALL_END)


def _tags(name: str) -> tuple[str, ...]:
    parser = PARSERS[name]()
    return (parser.marker, *parser.inner_tags)


@pytest.fixture(scope="module", params=["spelled", "special"])
def vocabulary(smollm2_dir, request):
    """SmolLM2's tokenizer, with every family's tags as special tokens or not, and its compiler."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    if request.param == "special":
        tags = sorted({tag for name in TAGGED + SECTIONS for tag in _tags(name)} | set(SECTION_TAGS))
        hf.add_special_tokens({"additional_special_tokens": tags})
    return hf, GrammarCompiler.from_hf(hf, cache_size=64, vocab_size=len(hf)), request.param == "special"


def _grammar(hf, name: str, tools, required: bool, parallel: bool) -> str:
    """The grammar as the gateway makes it: the family's special tags found in the tokenizer."""
    hf.chat_template = "{{ '" + PARSERS[name].cue + "' }}" if PARSERS[name].cue else "{{ '" + _tags(name)[0] + "' }}"
    chat = ChatFormat.detect(Tokenizer(hf), name, "none")
    return tool_call_grammar(chat.tool_parser, tools, required, parallel, chat.marker_token, dict(chat.special_tags))


def _accepts(compiler: GrammarCompiler, grammar: str, ids: list[int]) -> bool:
    matcher = compiler.matcher(Constraint(ConstraintKind.GRAMMAR, text=grammar))
    return bool(matcher.consume_tokens(ids)) and not matcher.is_error() and matcher.is_accepting()


def _ids(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", TAGGED + SECTIONS)
def test_special_tags_are_written_as_their_tokens(vocabulary, name) -> None:
    hf, compiler, special = vocabulary
    parser = PARSERS[name]()
    text = parser.render_calls([("book", {"city": "Paris", "nights": 2}), ("now", {})])
    for required in (True, False):
        grammar = _grammar(hf, name, TOOLS, required, True)
        assert _accepts(compiler, grammar, _ids(hf, text)), (name, required)
        spelled = hf.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert _accepts(compiler, grammar, spelled) == (not special), (name, required)
        assert _accepts(compiler, grammar, _ids(hf, "Let me see. " + text)) == (not required)
        assert not _accepts(compiler, grammar, _ids(hf, parser.render_calls([("book", {"city": "Paris"})])))


@pytest.mark.parametrize("name", TAGGED + SECTIONS)
@pytest.mark.parametrize("seed", range(3))
def test_random_walks_end_in_calls_that_validate(vocabulary, name, seed) -> None:
    """Sample a required call token by token, uniformly among the allowed tokens (stopping once
    the end is allowed): it parses, with the tools, into one call that validates."""
    hf, compiler, _ = vocabulary
    grammar = _grammar(hf, name, BOUNDED[:1] if seed else BOUNDED, True, False)
    matcher = compiler.matcher(Constraint(ConstraintKind.GRAMMAR, text=grammar))
    rng = random.Random(seed)
    ids: list[int] = []
    for _ in range(400):
        allowed = np.flatnonzero(np.unpackbits(np.frombuffer(bytes(matcher.compute_bitmask()), np.uint8),
                                               bitorder="little")[:len(hf)])
        if hf.eos_token_id in allowed:
            break
        token = int(rng.choice(allowed))
        assert matcher.consume_token(token)
        ids.append(token)
    assert matcher.is_accepting(), hf.decode(ids)
    text = hf.decode(ids)
    (call,) = PARSERS[name]().with_tools(BOUNDED).parse(text).calls
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def _tagged(name: str, value: str, key: str = "city", tool: str = "book") -> str:
    """One call of `tool` whose `key` is written as the text `value` (and nights as 2)."""
    parser = PARSERS[name]()
    return parser.render_calls([(tool, {key: value, **({"nights": 2} if tool == "book" else {})})])


@pytest.mark.parametrize("name", TAGGED)
def test_tagged_values_are_what_their_schema_says(vocabulary, name) -> None:
    hf, compiler, _ = vocabulary
    grammar = _grammar(hf, name, TOOLS, True, True)
    parser = PARSERS[name]().with_tools(TOOLS)
    # A string that reads as JSON is written bare and read back as the string.
    for text in ("42", "true", "null", '{"a": 1}', '"quoted"'):
        written = _tagged(name, text)
        assert _accepts(compiler, grammar, _ids(hf, written)), text
        assert json.loads(parser.parse(written).calls[0].arguments) == {"city": text, "nights": 2}
    # Without the tools the parser reads it as JSON, as before.
    assert json.loads(PARSERS[name]().parse(_tagged(name, "42")).calls[0].arguments)["city"] == 42
    # A value may not hold a tag that would end it, its call or its block.
    for closing in PARSERS[name]().inner_tags + ("</parameter>", "</function>", "</invoke>", "</arg_value>"):
        if closing in _tagged(name, "x"):
            assert not _accepts(compiler, grammar, _ids(hf, _tagged(name, f"Pa{closing}ris"))), closing
    assert not _accepts(compiler, grammar, _ids(hf, _tagged(name, "a" * 13)))  # maxLength 12
    # JSON where the schema is not a plain string: an integer, an array, a patterned string.
    nights = parser.render_calls([("book", {"city": "Oslo", "nights": "three"})])
    assert not _accepts(compiler, grammar, _ids(hf, nights))
    # (a length bound past RAW_MAX_LENGTH is a JSON string's too: the raw lexeme would not compile)
    note = parser.render_calls([("note", {"text": "hi", "tags": ["a", "b"], "code": json.dumps("ABC"),
                                          "essay": json.dumps("Long <b>")})])
    assert _accepts(compiler, grammar, _ids(hf, note))
    assert json.loads(parser.parse(note).calls[0].arguments) == {"text": "hi", "tags": ["a", "b"], "code": "ABC",
                                                                 "essay": "Long <b>"}
    for code in ("ABC", json.dumps("abc")):
        bad = parser.render_calls([("note", {"text": "hi", "code": code})])
        assert not _accepts(compiler, grammar, _ids(hf, bad)), code


@pytest.mark.parametrize("name", TAGGED)
def test_an_open_object_takes_any_keys(vocabulary, name) -> None:
    hf, compiler, _ = vocabulary
    grammar = _grammar(hf, name, TOOLS, True, True)
    written = PARSERS[name]().render_calls([("now", {"zone": "UTC", "offset": 2})])
    assert _accepts(compiler, grammar, _ids(hf, written))
    (call,) = PARSERS[name]().with_tools(TOOLS).parse(written).calls
    assert json.loads(call.arguments) == {"zone": "UTC", "offset": 2}


@pytest.mark.parametrize("name", TAGGED)
@pytest.mark.parametrize("schema, refused", [
    ({"anyOf": [{"type": "object"}], "properties": {}}, "'anyOf' at the top"),
    ({"type": "object", "minProperties": 1}, "'minProperties' at the top"),
    ({"type": "object", "properties": {"a<b": {"type": "string"}}}, "property name"),
    ({"type": "array"}, "must be an object schema"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 2}}}, "minLength above"),
])
def test_what_tagged_arguments_cannot_enforce_is_a_400(name, schema, refused) -> None:
    chat = ChatFormat(PARSERS[name](), True, None)
    tool = pb.Tool(name="odd", parameters=json.dumps(schema))
    for choice in (pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_AUTO)):
        request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="Hi")], tools=[tool],
                                     tool_choice=choice)
        with pytest.raises(InvalidRequest, match=f"tools: .*{refused}.*{name} call layout"):
            plan_chat(request, chat, 100_000)


@pytest.mark.parametrize("name", SECTIONS)
def test_section_arguments_are_the_tools_json_schema(vocabulary, name) -> None:
    hf, compiler, _ = vocabulary
    grammar = _grammar(hf, name, TOOLS, True, True)
    parser = PARSERS[name]()
    for calls, expected in (([("note", {"text": "hi", "code": "ABC"})], True),
                            ([("note", {"text": "hi", "code": "abc"})], False),
                            ([("book", {"city": "Paris", "nights": 20})], False),
                            ([("book", {"city": "Paris", "nights": 2, "pets": 1})], False)):
        assert _accepts(compiler, grammar, _ids(hf, parser.render_calls(calls))) == expected, calls
