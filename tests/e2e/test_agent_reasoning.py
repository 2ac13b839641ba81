"""Reasoning output and template-rendered tools through a whole stack, with the openai client.

The model folder is the tiny random model with SmolLM2's tokenizer and a chat template in the
style of Qwen3's (written for this test): it renders `tools` itself, shows the `<tool_call>`
layout, and closes an empty `<think>` block in the generation prompt when `enable_thinking` is
false. The gateway detects from it the Hermes parser and the think split. A random model does
not think on its own, so a regex constraint makes it write a thinking block and an answer: the
split is what is under test.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from constrained_model import make_constrained_model
from e2e.stack import LaunchedStack, launch
from procs import ServiceProcesses

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

{% endif %}{% endif %}"""
CHAT = [{"role": "user", "content": "What is two and two?"}]
# What the constraint makes the model write: a thinking block, then the answer.
THOUGHT = "<think>\n[a-z]{2,8}( [a-z]{2,8}){0,3}\n</think>\n\n[A-Z][a-z]{2,8}"
SPLIT = {"guided_regex": THOUGHT}
LEVEL_SCHEMA = {"type": "object", "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["level"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "set_level", "parameters": LEVEL_SCHEMA}}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2_dir):
    model_dir = make_constrained_model(tmp_path_factory.mktemp("thinker") / MODEL, smollm2_dir)
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


@pytest.mark.timeout(180)
def test_thinking_goes_to_reasoning_content_streamed_and_not(api, stack) -> None:
    fields = dict(model=MODEL, messages=CHAT, temperature=0, extra_body=SPLIT)
    message = api.chat.completions.create(**fields).choices[0].message
    reasoning, content = reasoning_of(message), message.content
    assert re.fullmatch(r"\n[a-z]{2,8}( [a-z]{2,8}){0,3}\n", reasoning), reasoning
    assert re.fullmatch(r"[A-Z][a-z]{2,8}", content), content
    deltas = [c.choices[0].delta for c in api.chat.completions.create(**fields, stream=True) if c.choices]
    assert "".join(reasoning_of(d) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    assert any(reasoning_of(d) for d in deltas) and not any(reasoning_of(d) and d.content for d in deltas[:1])
    # The whole text, unsplit, is what the model wrote: the split lost nothing.
    raw = api.completions.create(model=MODEL, prompt=_chat_prompt(stack), temperature=0, extra_body=SPLIT)
    assert raw.choices[0].text == f"<think>{reasoning}</think>\n\n{content}"


def _chat_prompt(stack: LaunchedStack) -> list[int]:
    """The rendered chat as token ids, from /tokenize."""
    reply = httpx.post(f"{stack.http_base}/tokenize", json={"model": MODEL, "messages": CHAT}, timeout=TIMEOUT_S)
    return reply.json()["tokens"]


@pytest.mark.timeout(120)
def test_enable_thinking_false_turns_the_split_off(api) -> None:
    message = api.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0,
        extra_body={**SPLIT, "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert reasoning_of(message) is None
    assert message.content.startswith("<think>\n") and "</think>\n\n" in message.content


@pytest.mark.timeout(120)
def test_template_renders_the_tools_and_calls_validate(api, stack) -> None:
    tokens = httpx.post(f"{stack.http_base}/tokenize", json={"messages": CHAT, "tools": TOOLS},
                        timeout=TIMEOUT_S).json()["tokens"]
    rendered = httpx.post(f"{stack.http_base}/detokenize", json={"tokens": tokens}, timeout=TIMEOUT_S).json()["prompt"]
    assert "# Tools" in rendered and '"name": "set_level"' in rendered  # the template's own words
    for stream in (False, True):
        reply = api.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, temperature=1.0, seed=3, stream=stream)
        if stream:
            parts = [p for c in reply for p in c.choices[0].delta.tool_calls or ()]
            name, arguments = parts[0].function.name, "".join(p.function.arguments or "" for p in parts)
        else:
            (call,) = reply.choices[0].message.tool_calls
            name, arguments = call.function.name, call.function.arguments
        assert name == "set_level"
        jsonschema.validate(json.loads(arguments), LEVEL_SCHEMA)
