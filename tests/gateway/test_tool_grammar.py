"""The tool-call grammar, compiled by llguidance against SmolLM2's tokenizer: it accepts exactly
the calls whose arguments validate against their tool's schema, laid out as the family's parser
reads them (and, in auto mode, plain text); parallel calls only when allowed."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from gateway_service.tool_grammar import call_schema, tool_call_grammar
from gateway_service.tool_parsers import PARSERS
from radixserve.constraints import Constraint, ConstraintKind
from radixserve.grammar_compiler import GrammarCompiler
from radixserve.v1 import generation_pb2 as pb

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"], "additionalProperties": False,
}
TOOLS = [pb.Tool(name="get_weather", parameters=json.dumps(WEATHER_SCHEMA)), pb.Tool(name="now")]
GOOD = [("get_weather", {"city": "Paris", "unit": "celsius"})]
TWO = [("get_weather", {"city": "Paris"}), ("now", {})]
BAD = [
    [("get_weather", {"town": "Paris"})],  # not in the schema
    [("get_weather", {"city": "Paris", "unit": "kelvin"})],  # not in the enum
    [("get_weather", {})],  # a required property missing
    [("forecast", {"city": "Paris"})],  # no such tool
]


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler.from_hf(tokenizer.hf, cache_size=64)


def accepts(compiler: GrammarCompiler, tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar lets the model write exactly `text` and then stop."""
    matcher = compiler.matcher(Constraint(ConstraintKind.GRAMMAR, text=grammar))
    ids = tokenizer.hf.encode(text, add_special_tokens=False)
    return bool(matcher.consume_tokens(ids)) and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize("family", [name for name, parser in PARSERS.items() if parser.constrained])
@pytest.mark.parametrize("required", [True, False])
def test_grammar_accepts_valid_calls_and_nothing_invalid(compiler, tokenizer, family, required) -> None:
    parser = PARSERS[family]()
    for parallel in (True, False):
        grammar = tool_call_grammar(parser, TOOLS, required, parallel)
        assert accepts(compiler, tokenizer, grammar, parser.render_calls(GOOD)), (family, parallel)
        assert accepts(compiler, tokenizer, grammar, parser.render_calls(TWO)) == parallel, (family, parallel)
        for calls in BAD:
            assert not accepts(compiler, tokenizer, grammar, parser.render_calls(calls)), (family, calls)
        # Auto: plain text too, and text before a call where the family has a marker.
        assert accepts(compiler, tokenizer, grammar, "The weather is fine.") == (not required)
        if family != "llama3_json":
            prefixed = "Let me check. " + parser.render_calls(GOOD)
            assert accepts(compiler, tokenizer, grammar, prefixed) == (not required)


@pytest.mark.parametrize("seed", range(5))
def test_random_walks_through_the_grammar_end_in_valid_calls(compiler, tokenizer, seed) -> None:
    """Sample the constrained output token by token, uniformly among the allowed tokens (EOS
    once it is allowed): what comes out parses and validates."""
    parser = PARSERS["hermes"]()
    grammar = tool_call_grammar(parser, TOOLS[:1], True, False)
    matcher = compiler.matcher(Constraint(ConstraintKind.GRAMMAR, text=grammar))
    eos = tokenizer.hf.eos_token_id
    rng = random.Random(seed)
    ids: list[int] = []
    for _ in range(300):
        mask = matcher.compute_bitmask()
        if mask[eos // 8] >> (eos % 8) & 1:
            break
        allowed = [i for i in range(len(tokenizer.hf)) if mask[i // 8] >> (i % 8) & 1]
        token = rng.choice(allowed)
        assert matcher.consume_token(token)
        ids.append(token)
    assert matcher.is_accepting()
    parsed = parser.parse(tokenizer.hf.decode(ids))
    assert len(parsed.calls) == 1 and parsed.calls[0].name == "get_weather"
    jsonschema.validate(json.loads(parsed.calls[0].arguments), WEATHER_SCHEMA)


def test_call_schema_is_name_then_arguments() -> None:
    schema = call_schema(TOOLS, "parameters")
    assert [list(option["properties"]) for option in schema["anyOf"]] == [["name", "parameters"]] * 2
    assert schema["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    assert schema["x-guidance"]["whitespace_flexible"] is False  # compact, as the parsers render


def test_a_marker_that_is_a_special_token_is_written_as_that_token(smollm2_dir) -> None:
    """Mistral's [TOOL_CALLS] is one special token: the grammar names it by id (text lexemes
    cannot produce it), and output text keeps it so that the parser finds it."""
    from transformers import AutoTokenizer

    from gateway_service.chat_format import ChatFormat
    from gateway_service.detokenizer import IncrementalDetokenizer
    from gateway_service.tokenizer import Tokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    hf.chat_template = "{{ '[AVAILABLE_TOOLS]' }}{{ tools | tojson }}{{ '[TOOL_CALLS]' }}"
    tokenizer = Tokenizer(hf)
    chat = ChatFormat.detect(tokenizer, "auto", "auto")
    marker = hf.convert_tokens_to_ids("[TOOL_CALLS]")
    assert chat.tool_parser.name == "mistral" and chat.marker_token == marker and chat.renders_tools
    compiler = GrammarCompiler.from_hf(hf, cache_size=8, vocab_size=len(hf))
    call = [marker, *hf.encode('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', add_special_tokens=False)]
    # The same call with the marker spelled out in plain text pieces: not what the model writes.
    as_text = hf.encode(chat.tool_parser.render_calls(GOOD), add_special_tokens=False, split_special_tokens=True)
    assert marker not in as_text
    for required in (True, False):
        grammar = tool_call_grammar(chat.tool_parser, TOOLS, required, True, chat.marker_token)
        for ids, expected in ((call, True), (as_text, False), (hf.encode("Hi.", add_special_tokens=False), not required)):
            matcher = compiler.matcher(Constraint(ConstraintKind.GRAMMAR, text=grammar))
            ok = bool(matcher.consume_tokens(ids)) and not matcher.is_error() and matcher.is_accepting()
            assert ok == expected, (required, hf.decode(ids))
    detokenizer = IncrementalDetokenizer(tokenizer.decode)
    text = "".join(detokenizer.add(token_id) for token_id in call) + detokenizer.flush()
    assert text.startswith("[TOOL_CALLS][")
    assert [c.name for c in chat.tool_parser.parse(text).calls] == ["get_weather"]
    assert tokenizer.decode([*hf.encode("a", add_special_tokens=False), hf.eos_token_id]) == "a"  # others still go


def test_llama_text_may_not_hide_a_tagged_call(compiler, tokenizer) -> None:
    """Llama's parser reads a call after <|python_tag|> anywhere: auto text may not contain it."""
    grammar = tool_call_grammar(PARSERS["llama3_json"](), TOOLS, False, True)
    assert accepts(compiler, tokenizer, grammar, "It is {warm} today.")
    assert not accepts(compiler, tokenizer, grammar, 'Sure <|python_tag|>{"name": "forecast", "parameters": {}}')
    assert not accepts(compiler, tokenizer, grammar, '  {"name": "forecast", "parameters": {}}')
