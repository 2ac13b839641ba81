"""Building a GenerateRequest or an EmbedRequest from arguments (shared by both clients)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from radixserve.v1 import generation_pb2

Message = Mapping[str, Any] | tuple[str, str] | generation_pb2.ChatMessage
# The fields a message mapping may hold, as OpenAI's chat messages name them.
MESSAGE_FIELDS = ("role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content")


def chat_messages(messages: Iterable[Message]) -> list[generation_pb2.ChatMessage]:
    """Messages as `ChatMessage`s, `(role, content)` pairs or mappings as OpenAI's chat messages
    are (`MESSAGE_FIELDS`: an assistant turn's `tool_calls` in OpenAI's shape, `{"id", "function":
    {"name", "arguments"}}`, arguments as JSON text or a mapping). A key the message cannot carry
    is a ValueError naming it, never dropped."""
    result = []
    for index, message in enumerate(messages):
        if isinstance(message, generation_pb2.ChatMessage):
            result.append(message)
        elif isinstance(message, Mapping):
            unknown = sorted(set(message) - set(MESSAGE_FIELDS))
            if unknown:
                raise ValueError(f"messages[{index}]: {', '.join(unknown)} is not a field a chat message carries "
                                 f"(known: {', '.join(MESSAGE_FIELDS)})")
            fields = {key: message[key] for key in MESSAGE_FIELDS[:4] + MESSAGE_FIELDS[5:] if message.get(key)}
            calls = [_tool_call(call) for call in message.get("tool_calls") or ()]
            result.append(generation_pb2.ChatMessage(tool_calls=calls, **fields))
        else:
            role, content = message
            result.append(generation_pb2.ChatMessage(role=role, content=content))
    return result


def _tool_call(call: Mapping[str, Any]) -> generation_pb2.ToolCall:
    function = call.get("function") or {}
    arguments = function.get("arguments") or {}
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return generation_pb2.ToolCall(id=call.get("id") or "", name=function.get("name") or "", arguments=arguments)


def generate_request(
    prompt: str | None = None,
    messages: Iterable[Message] | None = None,
    *,
    max_tokens: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    request_id: str = "",
) -> generation_pb2.GenerateRequest:
    """Sampling options left at None stay unset, so the server's documented defaults apply."""
    sampling = generation_pb2.SamplingParams()
    for name, value in (
        ("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("min_p", min_p),
        ("repetition_penalty", repetition_penalty), ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty), ("seed", seed),
    ):
        if value is not None:
            setattr(sampling, name, value)
    request = generation_pb2.GenerateRequest(
        prompt=prompt or "",
        messages=chat_messages(messages or ()),
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        sampling=sampling,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        request_id=request_id,
    )
    if max_tokens is not None:
        request.max_tokens = max_tokens
    return request


def embed_request(inputs: str | Sequence[int] | Sequence[str | Sequence[int]],
                  dimensions: int | None = None) -> generation_pb2.EmbedRequest:
    """One text, one list of token ids, or a list of either: one `EmbedInput` each."""
    if isinstance(inputs, str) or (inputs and all(isinstance(item, int) for item in inputs)):
        inputs = [inputs]
    request = generation_pb2.EmbedRequest(inputs=[
        generation_pb2.EmbedInput(text=item) if isinstance(item, str)
        else generation_pb2.EmbedInput(tokens=generation_pb2.TokenIds(token_ids=list(item)))
        for item in inputs])
    if dimensions is not None:
        request.dimensions = dimensions
    return request
