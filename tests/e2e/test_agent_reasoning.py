"""Reasoning output and template-rendered tools through a whole stack, with the openai client.

The model folder is the tiny random model with SmolLM2's tokenizer, `<think>` and `</think>` added
as special tokens (the model's vocabulary has rows for them), and a chat template in the style of
Qwen3's (written for this test): it renders `tools` itself, shows the `<tool_call>` layout, closes
an empty `<think>` block in the generation prompt when `enable_thinking` is false, and opens one
when `opened` is true. The gateway detects from it the Hermes parser and the think split.

A random model does not think on its own: a logit bias on `<think>` makes it open the block, and a
smaller one on `</think>` makes it close the block after some sampled tokens (none to a few dozen,
by seed). The constraint (a regex, the tools' grammar) binds only the answer after the block, as
rank 0 enforces it (`gateway_service.reasoning_constraint`): the split and that binding are under
test, over several seeds, whatever each seed's thoughts are.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from constrained_model import SMOLLM2_VOCAB_SIZE, with_smollm2_tokenizer
from e2e.stack import LaunchedStack, launch
from procs import ServiceProcesses
from worker.tiny_models import make_tiny_llama

MODEL = "tiny-thinker"
TIMEOUT_S = 60.0
TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
Functions you may call:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
A call is written <tool_call>
{"name": <name>, "arguments": <object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}{% for call in message.tool_calls or [] %}<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif opened is defined and opened %}<think>
{% endif %}{% endif %}"""
CHAT = [{"role": "user", "content": "What is two and two?"}]
OPEN_ID, CLOSE_ID = SMOLLM2_VOCAB_SIZE, SMOLLM2_VOCAB_SIZE + 1  # <think>, </think>
# Open the block at once (the only place the grammar allows it); close it after some tokens.
THINK_BIAS = {str(OPEN_ID): 100, str(CLOSE_ID): 8}
ANSWER = "[A-Z][a-z]{2,8}"
SPLIT = {"guided_regex": ANSWER, "logit_bias": THINK_BIAS}
SEEDS = range(1, 9)
# Room for the longest thoughts a seed takes, so that every answer finishes.
THINKING_MAX_TOKENS = 256
LEVEL_SCHEMA = {"type": "object", "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["level"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "set_level", "parameters": LEVEL_SCHEMA}}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2_dir):
    from transformers import AutoTokenizer

    model_dir = tmp_path_factory.mktemp("thinker") / MODEL
    make_tiny_llama(model_dir, vocab_size=SMOLLM2_VOCAB_SIZE + 2)
    with_smollm2_tokenizer(model_dir, smollm2_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    assert tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) == [OPEN_ID, CLOSE_ID]
    tokenizer.save_pretrained(str(model_dir))
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    with ServiceProcesses() as procs:
        yield launch(procs, model_dir, tp=1, default_max_tokens=48, with_http=True)


@pytest.fixture(scope="module")
def api(stack: LaunchedStack) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{stack.http_base}/v1", api_key="unused", max_retries=0,
                       timeout=TIMEOUT_S) as client:
        yield client


def reasoning_of(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("opened", [False, True])
def test_thinking_goes_to_reasoning_content_and_the_constraint_binds_the_answer(api, opened) -> None:
    """The model thinks (in a block it opens, or one the prompt opened) and then answers: the
    reasoning is free text, the answer is what the regex allows, streamed as not."""
    thought = []
    for seed in SEEDS:
        fields = dict(model=MODEL, messages=CHAT, temperature=1.0, seed=seed, max_tokens=THINKING_MAX_TOKENS,
                      extra_body={**SPLIT, "chat_template_kwargs": {"opened": opened}})
        choice = api.chat.completions.create(**fields).choices[0]
        reasoning, content = reasoning_of(choice.message), choice.message.content
        assert choice.finish_reason == "stop" and re.fullmatch(ANSWER, content), (seed, reasoning, content)
        assert "think>" not in (reasoning or ""), reasoning
        if reasoning:
            thought.append((fields, reasoning, content))
    assert thought, "no seed thought before answering"
    fields, reasoning, content = thought[0]
    deltas = [c.choices[0].delta for c in api.chat.completions.create(**fields, stream=True) if c.choices]
    assert "".join(reasoning_of(d) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    assert any(reasoning_of(d) for d in deltas) and not any(reasoning_of(d) and d.content for d in deltas[:1])


@pytest.mark.timeout(120)
def test_a_model_that_does_not_think_answers_at_once(api) -> None:
    message = api.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                          extra_body={"guided_regex": ANSWER}).choices[0].message
    assert reasoning_of(message) is None and re.fullmatch(ANSWER, message.content), message


@pytest.mark.timeout(120)
def test_enable_thinking_false_turns_the_split_off(api) -> None:
    """The template closes an empty block itself; a block the model still writes is content, and
    a constraint binds the output from its first token."""
    message = api.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=8,
        extra_body={"logit_bias": THINK_BIAS, "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert reasoning_of(message) is None and message.content.startswith("<think>"), message
    message = api.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0,
        extra_body={**SPLIT, "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert reasoning_of(message) is None and re.fullmatch(ANSWER, message.content), message


@pytest.mark.timeout(120)
def test_template_renders_the_tools_and_calls_validate(api, stack) -> None:
    tokens = httpx.post(f"{stack.http_base}/tokenize", json={"messages": CHAT, "tools": TOOLS},
                        timeout=TIMEOUT_S).json()["tokens"]
    rendered = httpx.post(f"{stack.http_base}/detokenize", json={"tokens": tokens}, timeout=TIMEOUT_S).json()["prompt"]
    assert "# Tools" in rendered and '"name": "set_level"' in rendered  # the template's own words
    for stream, seed in [(False, seed) for seed in SEEDS[:3]] + [(True, SEEDS[0])]:  # it thinks, then must call
        reply = api.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, stream=stream, temperature=1.0, seed=seed,
                                            max_tokens=THINKING_MAX_TOKENS, extra_body={"logit_bias": THINK_BIAS})
        if stream:
            chunks = [c.choices[0].delta for c in reply if c.choices]
            parts = [p for delta in chunks for p in delta.tool_calls or ()]
            name, arguments = parts[0].function.name, "".join(p.function.arguments or "" for p in parts)
            reasoning = "".join(reasoning_of(delta) or "" for delta in chunks)
        else:
            (call,) = reply.choices[0].message.tool_calls
            name, arguments = call.function.name, call.function.arguments
            reasoning = reasoning_of(reply.choices[0].message)
        assert "think>" not in (reasoning or ""), reasoning
        assert name == "set_level"
        jsonschema.validate(json.loads(arguments), LEVEL_SCHEMA)


@pytest.mark.timeout(120)
def test_a_constraint_rank_0_cannot_follow_is_an_error_never_a_finished_output(api) -> None:
    """A regex that spells a special token's text: the grammar library offers that token, then
    cannot take it (llguidance 1.x), so rank 0's matcher errs. The request ends with a 400 naming
    the constraint, where it ended as "stop" with an output the regex does not match."""
    try:
        message = api.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=0, max_tokens=16,
            extra_body={"guided_regex": "<think>[a-z]{3}", "chat_template_kwargs": {"enable_thinking": False}},
        ).choices[0].message
    except openai.BadRequestError as exc:
        assert "constraint: the output could not follow it" in str(exc)
    else:  # a library that can follow it: then the output matches
        assert re.fullmatch("<think>[a-z]{3}", message.content), message
