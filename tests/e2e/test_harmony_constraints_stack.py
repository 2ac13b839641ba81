"""Constraints in harmony through a whole stack, with the openai client: a tiny random model whose
tokenizer is SmolLM2's with the harmony markers added as special tokens (its vocabulary has rows
for them) and a chat template that writes harmony, so the gateway reads its outputs as gpt-oss's.

A random model writes no harmony on its own; rank 0's grammar makes it (`harmony_grammar`), and a
logit bias leans it towards an analysis message and towards closing it after some sampled tokens.
Over several seeds, whatever each one's thoughts: the answer of `response_format` comes back as
content that validates, the analysis as reasoning, and a required call validates against its
tool.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from constrained_model import SMOLLM2_VOCAB_SIZE, with_smollm2_tokenizer
from e2e.stack import launch
from gateway_service import harmony
from harmony_chat import HARMONY_TEMPLATE
from procs import ServiceProcesses
from worker.tiny_models import make_tiny_llama

MODEL = "tiny-harmony"
TIMEOUT_S = 60.0
CHAT = [{"role": "user", "content": "Is it sunny?"}]
MARKER_IDS = {marker: SMOLLM2_VOCAB_SIZE + index for index, marker in enumerate(harmony.MARKERS)}
# Close an analysis body after some sampled tokens.
BIAS = {str(MARKER_IDS[harmony.END]): 8}
# And lean towards opening one: about half the seeds then write an analysis first (more bias
# and the model writes analysis messages one after another until max_tokens).
ANALYSIS_TOKEN = 14975  # "analysis" in SmolLM2's vocabulary
THINK_BIAS = {**BIAS, str(ANALYSIS_TOKEN): 4}
WEATHER = {"type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"],
           "additionalProperties": False}
LEVEL = {"type": "object", "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["level"], "additionalProperties": False}
SEEDS = range(1, 13)
MAX_TOKENS = 400  # the tiny model's context is 512


@pytest.fixture(scope="module")
def api(tmp_path_factory, smollm2_dir):
    from transformers import AutoTokenizer

    model_dir = tmp_path_factory.mktemp("harmony") / MODEL
    make_tiny_llama(model_dir, vocab_size=SMOLLM2_VOCAB_SIZE + len(harmony.MARKERS))
    with_smollm2_tokenizer(model_dir, smollm2_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": list(harmony.MARKERS)})
    assert tokenizer.convert_tokens_to_ids(list(harmony.MARKERS)) == list(MARKER_IDS.values())
    tokenizer.save_pretrained(str(model_dir))
    (model_dir / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    with ServiceProcesses() as procs:
        stack = launch(procs, model_dir, tp=1, default_max_tokens=48, with_http=True)
        with openai.OpenAI(base_url=f"{stack.http_base}/v1", api_key="unused", max_retries=0,
                           timeout=TIMEOUT_S) as client:
            yield client


def _reasoning(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


@pytest.mark.timeout(240)
def test_response_format_binds_the_final_message_after_the_analysis(api) -> None:
    thought = 0
    for seed in SEEDS:
        choice = api.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, logit_bias=THINK_BIAS,
            response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}},
        ).choices[0]
        reasoning = _reasoning(choice.message)
        assert choice.finish_reason == "stop", (seed, reasoning, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), WEATHER)
        assert "<|" not in (reasoning or "") and "<|" not in choice.message.content
        thought += bool(reasoning)
    assert thought, "no seed wrote an analysis"


@pytest.mark.timeout(240)
def test_a_required_call_validates_after_the_analysis(api) -> None:
    tools = [{"type": "function", "function": {"name": "set_level", "parameters": LEVEL}}]
    for seed in list(SEEDS)[:4]:
        choice = api.chat.completions.create(
            model=MODEL, messages=CHAT, tools=tools, tool_choice="required", temperature=1.0, seed=seed,
            max_tokens=MAX_TOKENS, logit_bias=BIAS).choices[0]
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and call.function.name == "set_level"
        jsonschema.validate(json.loads(call.function.arguments), LEVEL)
        assert "<|" not in (_reasoning(choice.message) or "")
