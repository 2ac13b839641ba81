"""OpenAI response bodies (plain dicts, serialized by the app) built from the gateway's chunks
(`GenerateResponse` messages; finish reasons in words from `radixserve.finish_reason`).

Chat and completion bodies differ in the choice's payload (`message`/`delta` vs `text`) and in
the shape of logprobs; everything else (ids, usage, finish reasons) is shared here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.finish_reason import finish_reason_text
from radixserve.v1 import generation_pb2

Chunk = generation_pb2.GenerateResponse
TokenLogprob = generation_pb2.TokenLogprob
Usage = generation_pb2.Usage

CHAT_OBJECT = "chat.completion"
CHAT_CHUNK_OBJECT = "chat.completion.chunk"
COMPLETION_OBJECT = "text_completion"


@dataclass(frozen=True, slots=True)
class ResponseHeader:
    """What every body or chunk of one response repeats."""

    id: str
    object: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, object_name: str, model: str) -> "ResponseHeader":
        return cls(f"{prefix}-{uuid.uuid4().hex}", object_name, int(time.time()), model)

    def body(self, **fields) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                **fields}


@dataclass(slots=True)
class ChoiceOutput:
    """One choice accumulated over its chunks (non-streaming responses)."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[generation_pb2.ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: int = generation_pb2.FINISH_REASON_UNSPECIFIED
    usage: Usage | None = None

    def add(self, chunk: Chunk) -> None:
        self.text.append(chunk.text)
        self.reasoning.append(chunk.reasoning_text)
        self.tool_calls.extend(chunk.tool_calls)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
            self.usage = chunk.usage


def usage_body(usages: Sequence[Usage], num_prompts: int = 1) -> dict:
    """Usage over all choices: each prompt counts once however many choices it has."""
    per_prompt = len(usages) // num_prompts if num_prompts else 0
    prompt = sum(u.prompt_tokens for u in usages[::per_prompt]) if per_prompt else 0
    cached = sum(u.cached_tokens for u in usages[::per_prompt]) if per_prompt else 0
    completion = sum(u.completion_tokens for u in usages)
    drafted = sum(u.draft_tokens for u in usages)
    accepted = sum(u.accepted_draft_tokens for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        # Speculative decoding's drafts, in the fields OpenAI uses for predicted outputs.
        "completion_tokens_details": {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        },
    }


# --- chat ------------------------------------------------------------------------------------

def chat_logprobs(logprobs: Sequence[TokenLogprob]) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(lp.token, lp.logprob),
             "top_logprobs": [entry(t.token, t.logprob) for t in lp.top_logprobs]}
            for lp in logprobs
        ]
    }


def tool_call_body(call: generation_pb2.ToolCall, streamed: bool = False) -> dict:
    """A call; streamed, a delta: the first of a call has its id and name, later ones (no id)
    only more of the arguments."""
    if streamed and not call.id:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    body = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": call.index, **body} if streamed else body


def chat_message(choice: ChoiceOutput) -> dict:
    """The assistant's message: content is null when the answer is only tool calls."""
    content = "".join(choice.text)
    message: dict = {"role": "assistant", "content": content or (None if choice.tool_calls else "")}
    reasoning = "".join(choice.reasoning)
    if reasoning:
        message["reasoning_content"] = reasoning
    if choice.tool_calls:
        message["tool_calls"] = [tool_call_body(call) for call in choice.tool_calls]
    return message


def chat_choice(index: int, choice: ChoiceOutput, with_logprobs: bool) -> dict:
    return {
        "index": index,
        "message": chat_message(choice),
        "logprobs": chat_logprobs(choice.logprobs) if with_logprobs else None,
        "finish_reason": finish_reason_text(choice.finish_reason),
    }


def chat_delta(index: int, chunk: Chunk | None, with_logprobs: bool, first: bool) -> dict:
    """A streamed choice; the first one of each choice carries the role, as OpenAI's does."""
    delta: dict = {"role": "assistant", "content": ""} if first else {}
    if chunk is not None and chunk.text:
        delta["content"] = chunk.text
    if chunk is not None and chunk.reasoning_text:
        delta["reasoning_content"] = chunk.reasoning_text
    if chunk is not None and chunk.tool_calls:
        delta["tool_calls"] = [tool_call_body(call, streamed=True) for call in chunk.tool_calls]
    logprobs = chat_logprobs(chunk.logprobs) if with_logprobs and chunk is not None else None
    reason = None if chunk is None else finish_reason_text(chunk.finish_reason)
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


# --- completions -----------------------------------------------------------------------------

def completion_logprobs(logprobs: Sequence[TokenLogprob], text_offset: int = 0) -> dict:
    offsets = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs} for lp in logprobs],
        "text_offset": offsets,
    }


def completion_choice(index: int, text: str, logprobs: Sequence[TokenLogprob] | None,
                      reason: int, text_offset: int = 0) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": None if logprobs is None else completion_logprobs(logprobs, text_offset),
        "finish_reason": finish_reason_text(reason),
    }
