"""A constraint behind the reasoning block (`reasoning_constraint`), compiled by llguidance against
SmolLM2's tokenizer with `<think>`/`</think>` spelled as text and as special tokens: the model may
think first (one block, any text without `</think>`) or answer at once, and the answer is bound
by the constraint whatever its kind; where the prompt opened the block, the output starts inside
it and must close it before answering."""

from __future__ import annotations

import json

import pytest

from gateway_service.reasoning_constraint import reasoning_then
from radixserve.constraints import Constraint, ConstraintKind
from radixserve.grammar_compiler import GrammarCompiler

SCHEMA = {"type": "object", "properties": {"level": {"type": "integer"}}, "required": ["level"],
          "additionalProperties": False}
# Each kind, with an answer it allows and one it does not.
KINDS = [
    (Constraint(ConstraintKind.JSON_SCHEMA, text=json.dumps(SCHEMA)), '{"level": 3}', '{"level": "3"}'),
    (Constraint(ConstraintKind.JSON_OBJECT), '{"a": [1]}', "[1]"),
    (Constraint(ConstraintKind.REGEX, text="[A-Z][a-z]{2,8}"), "Four", "four"),
    (Constraint(ConstraintKind.CHOICE, choices=("yes", "no")), "no", "maybe"),
    (Constraint(ConstraintKind.GRAMMAR, text='start: "a" B\nB: /[0-9]+/\n'), "a42", "b42"),
    (Constraint(ConstraintKind.GRAMMAR, text='root ::= "x" [0-9]'), "x7", "x"),
]


@pytest.fixture(scope="module", params=["spelled", "special"])
def vocabulary(smollm2_dir, request):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    special = {}
    if request.param == "special":
        hf.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
        special = {tag: hf.convert_tokens_to_ids(tag) for tag in ("<think>", "</think>")}
    return hf, GrammarCompiler.from_hf(hf, cache_size=64, vocab_size=len(hf)), special


def _accepts(vocabulary, constraint: Constraint, text: str) -> bool:
    hf, compiler, _ = vocabulary
    matcher = compiler.matcher(constraint)
    ids = hf.encode(text, add_special_tokens=False)
    return bool(matcher.consume_tokens(ids)) and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize("constraint, good, bad", KINDS, ids=lambda value: getattr(value, "kind", value))
def test_the_answer_after_an_optional_block_is_bound(vocabulary, constraint, good, bad) -> None:
    wrapped = reasoning_then(constraint, vocabulary[2], inside=False)
    assert wrapped.kind is ConstraintKind.LLGUIDANCE and not wrapped.problems()
    for thinking in ("", "<think>Two and two: {four}, not <b>.</think>", "\n<think>\n</think>\n\n",
                     "<think>x</think>\n"):
        assert _accepts(vocabulary, wrapped, thinking + good), thinking
        assert not _accepts(vocabulary, wrapped, thinking + bad), thinking
    assert not _accepts(vocabulary, wrapped, "<think>one</think>two</think>" + good)  # one block
    assert not _accepts(vocabulary, wrapped, "<think>still thinking")  # not done
    assert not _accepts(vocabulary, wrapped, "Sure! " + good)  # text before the answer is no block


@pytest.mark.parametrize("constraint, good, bad", KINDS[:3], ids=lambda value: getattr(value, "kind", value))
def test_inside_an_open_block_the_output_closes_it_first(vocabulary, constraint, good, bad) -> None:
    wrapped = reasoning_then(constraint, vocabulary[2], inside=True)
    assert _accepts(vocabulary, wrapped, "Two and two.\n</think>\n\n" + good)
    assert _accepts(vocabulary, wrapped, "</think>" + good)
    assert not _accepts(vocabulary, wrapped, "Two and two.</think>" + bad)
    assert not _accepts(vocabulary, wrapped, good)  # the block is still open


def test_special_tags_are_their_tokens(vocabulary) -> None:
    hf, compiler, special = vocabulary
    if not special:
        pytest.skip("the tags are spelled in this tokenizer")
    wrapped = reasoning_then(KINDS[2][0], special, inside=False)
    spelled = hf.encode("<think>a</think>Four", add_special_tokens=False, split_special_tokens=True)
    matcher = compiler.matcher(wrapped)
    assert not (matcher.consume_tokens(spelled) and matcher.is_accepting())
    assert _accepts(vocabulary, wrapped, "<think>a</think>Four")


THINKING_TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
                     "{%- if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                     "{% elif opened is defined and opened %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinking_gateway(smollm2_dir):
    """A gateway whose template thinks (Qwen3's switch, and a variable that opens the block in
    the generation prompt), with fake routers."""
    from transformers import AutoTokenizer

    from gateway.harness import start_harness, stop_harness
    from gateway_service.tokenizer import Tokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    hf.chat_template = THINKING_TEMPLATE
    running = start_harness(Tokenizer(hf), num_routers=1, with_http=True)
    try:
        yield running
    finally:
        stop_harness(running)


def test_the_gateway_sends_the_answers_constraint_behind_the_block(thinking_gateway, smollm2_dir) -> None:
    import openai

    from gateway.harness import EOS_TOKEN_ID

    harness = thinking_gateway
    tokenizer = harness.gateway.servicer.tokenizer
    compiler = GrammarCompiler.from_hf(tokenizer.hf, cache_size=8)
    answer = '{"level": 3}'
    schema = {"type": "json_schema", "json_schema": {"name": "level", "schema": SCHEMA}}
    base = f"http://127.0.0.1:{harness.gateway.http.port}/v1"
    cases = [({}, "<think>Hm.</think>\n\n", True), ({"opened": True}, "Hm.\n</think>\n\n", True),
             ({"enable_thinking": False}, "", False)]
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=10.0) as api:
        for kwargs, thinking, split in cases:
            harness.script_all(tokenizer.hf.encode(thinking + answer, add_special_tokens=False) + [EOS_TOKEN_ID])
            message = api.chat.completions.create(
                model="fake-smollm2", messages=[{"role": "user", "content": "Level?"}], response_format=schema,
                extra_body={"chat_template_kwargs": kwargs}).choices[0].message
            assert message.content == answer, kwargs
            sent = harness.sent_constraint()
            assert sent.kind is (ConstraintKind.LLGUIDANCE if split else ConstraintKind.JSON_SCHEMA), kwargs
            matcher = compiler.matcher(sent)
            assert matcher.consume_tokens(tokenizer.hf.encode(thinking + answer, add_special_tokens=False))
            assert matcher.is_accepting(), kwargs
