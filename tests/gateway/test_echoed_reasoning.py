"""An echoed assistant turn's reasoning reaches the chat template: `reasoning_content` (or
`reasoning`, the other name servers answer with) over HTTP and gRPC's `ChatMessage` field, given
to the template as `reasoning_content` (Qwen3's name) and `thinking` (gpt-oss's, which shows it
before a tool call). A template here renders both, so the prompt the router receives shows what
arrived; reasoning on a non-assistant turn, two differing names, and reasoning past the prompt's
character limit are 400s."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from gateway.harness import EOS_TOKEN_ID, GatewayHarness, start_harness, stop_harness
from gateway_service.tokenizer import Tokenizer
from gateway_service.validation import RequestLimits
from radixserve.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(60)
MODEL = "fake-smollm2"
TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n"
            "{%- if m.reasoning_content %}[r:{{ m.reasoning_content }}]{% endif %}"
            "{%- if m.thinking %}[t:{{ m.thinking }}]{% endif %}{{ m.content }}<|im_end|>\n{%- endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def harness(smollm2_dir) -> Iterator[GatewayHarness]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    hf.chat_template = TEMPLATE
    running = start_harness(Tokenizer(hf), num_routers=1, with_http=True,
                            settings={"limits": RequestLimits(max_prompt_chars=2000)})
    try:
        yield running
    finally:
        stop_harness(running)


def _chat(harness: GatewayHarness, messages: list[dict]) -> httpx.Response:
    harness.script_all([EOS_TOKEN_ID])
    return httpx.post(f"http://127.0.0.1:{harness.gateway.http.port}/v1/chat/completions", timeout=10,
                      json={"model": MODEL, "messages": messages, "max_tokens": 2})


def _last_prompt(harness: GatewayHarness) -> str:
    return harness.gateway.servicer.tokenizer.hf.decode(harness.all_requests()[-1].prompt_token_ids)


@pytest.mark.parametrize("name", ["reasoning_content", "reasoning"])
def test_an_echoed_turns_reasoning_reaches_the_template_under_both_names(harness, name) -> None:
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello.", name: "They greeted me."},
                {"role": "user", "content": "Bye"}]
    reply = _chat(harness, messages)
    assert reply.status_code == 200, reply.text
    prompt = _last_prompt(harness)
    assert "[r:They greeted me.][t:They greeted me.]Hello." in prompt
    assert prompt.count("They greeted me.") == 2  # once per name, on that turn only


def test_the_grpc_field_reaches_the_template(harness) -> None:
    harness.script_all([EOS_TOKEN_ID])
    request = pb.GenerateRequest(max_tokens=2, messages=[
        pb.ChatMessage(role="user", content="Hi"),
        pb.ChatMessage(role="assistant", content="Hello.", reasoning_content="A greeting."),
        pb.ChatMessage(role="user", content="Bye")])
    list(harness.stub.Generate(request, timeout=10))
    assert "[r:A greeting.][t:A greeting.]Hello." in _last_prompt(harness)


@pytest.mark.parametrize(("messages", "named"), [
    ([{"role": "user", "content": "Hi", "reasoning_content": "no"}], "only assistant messages have reasoning"),
    ([{"role": "assistant", "content": "A", "reasoning_content": "x", "reasoning": "y"},
      {"role": "user", "content": "B"}], "reasoning_content and reasoning differ"),
    ([{"role": "assistant", "content": "A", "reasoning_content": "x" * 3000},
      {"role": "user", "content": "B"}], "more than the limit"),
])
def test_reasoning_where_it_cannot_be_is_refused(harness, messages, named) -> None:
    before = len(harness.all_requests())
    reply = _chat(harness, messages)
    assert reply.status_code == 400 and named in reply.json()["error"]["message"], reply.text
    assert len(harness.all_requests()) == before
