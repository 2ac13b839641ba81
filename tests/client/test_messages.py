"""The Python client's chat messages carry what an OpenAI chat message holds (tool calls in
OpenAI's shape, a tool turn's call id and name, an assistant turn's reasoning), and a key they
cannot carry is an error naming it: the client never drops part of a message."""

from __future__ import annotations

import json

import pytest

from radixserve.v1.generation_pb2 import ChatMessage, ToolCall
from radixserve_client.request import chat_messages


def test_openai_shaped_messages_keep_every_field() -> None:
    history = [
        ("system", "Be brief."),
        {"role": "user", "content": "Weather in Paris?", "name": "alice"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"},
        ChatMessage(role="user", content="Thanks"),
    ]
    turns = chat_messages(history)
    assert turns[0] == ChatMessage(role="system", content="Be brief.")
    assert turns[1] == ChatMessage(role="user", content="Weather in Paris?", name="alice")
    assert turns[2].reasoning_content == "Need the tool."
    assert list(turns[2].tool_calls) == [ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}'),
                                         ToolCall(id="c2", name="get_time", arguments=json.dumps({"tz": "CET"}))]
    assert turns[3] == ChatMessage(role="tool", content="sunny", tool_call_id="c1", name="get_weather")
    assert turns[4] is history[4]


def test_a_key_a_message_cannot_carry_is_named() -> None:
    with pytest.raises(ValueError, match=r"messages\[1\]: function_call is not a field"):
        chat_messages([("user", "hi"), {"role": "assistant", "content": "", "function_call": {"name": "f"}}])
