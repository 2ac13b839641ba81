"""OpenAI request bodies and their mapping onto the public `GenerateRequest` message.

pydantic checks only the JSON types here; every range and rule (temperature in [0, 2], stop
strings, top_logprobs, chat roles, constraints...) is checked by `gateway_service.validation`
and the constraint checker, the same code the gRPC API goes through. A field the body does not
declare is a 400 naming it unless it changes nothing (`unsupported`), as OpenAI answers
"Unrecognized request argument"; the types are strict (`openai_api.body` validates with `strict=True`:
a string is not a boolean). `user` is the caller's end-user id, for logs only. Structured output
comes as OpenAI's `response_format` (`json_schema`, `json_object`; `text` is no constraint) or
as the `guided_*` extras other servers accept; at most one of them per request.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway_service.errors import InvalidRequest
from gateway_service.openai_api import tool_protocol
from gateway_service.openai_api.unsupported import CHAT, COMPLETIONS, MESSAGE, refuse_unsupported
from radixserve import constraints
from radixserve.constraints import Constraint, ConstraintKind
from radixserve.sampling import seed_problem
from radixserve.v1 import generation_pb2

# JSON integers are unbounded; the message's int32 fields are not. A value past int32 is out of
# every range validation allows (top_k past the vocabulary means "all"), so clamping keeps the
# verdict and the message naming the field.
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1

# OpenAI's newer name for the system role.
ROLE_ALIASES = {"developer": "system"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    # vLLM's `continuous_usage_stats` and the like would change the stream's shape: refused.
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    # OpenAI's padding against length side channels: none is added here either way.
    include_obfuscation: bool | None = None


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    # `schema` would shadow a pydantic method name.
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    # Undeclared fields are kept for `unsupported.refuse_unsupported` (MESSAGE).
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[tool_protocol.ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # An echoed assistant turn's reasoning, under either name servers answer with.
    reasoning_content: str | None = None
    reasoning: str | None = None


class _Common(_Body):
    """Fields both endpoints share, with the extras other servers accept at the top level. The
    fields it does not declare are kept (`model_extra`) for `unsupported.refuse_unsupported`."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Token id (as a string, OpenAI's shape) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[tool_protocol.ToolDefinition] | None = None
    tool_choice: tool_protocol.ToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Common):
    # Text, texts, token ids, or lists of token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    # Completions take the number of alternatives per token here (0 to 20).
    logprobs: int | None = None
    echo: bool = False


Endpoint = Literal["chat", "completions"]  # unsupported.CHAT, unsupported.COMPLETIONS


def _reasoning(message: ChatMessage, index: int) -> str:
    """An echoed turn's reasoning: `reasoning_content` or `reasoning`, one text (both, differing:
    a 400 naming them)."""
    given = {text for text in (message.reasoning_content, message.reasoning) if text}
    if len(given) > 1:
        raise InvalidRequest(f"messages[{index}]: reasoning_content and reasoning differ; send one")
    return given.pop() if given else ""


def chat_input(body: ChatCompletionRequest, max_choices: int) -> generation_pb2.GenerateRequest:
    check_choices(body.n, max_choices)
    refuse_unsupported(body.model_extra, CHAT)
    for index, message in enumerate(body.messages):
        refuse_unsupported(message.model_extra, MESSAGE, f"messages[{index}].")
    turns = [
        generation_pb2.ChatMessage(role=ROLE_ALIASES.get(m.role, m.role), content=_text(m.content, index),
                                   reasoning_content=_reasoning(m, index), **tool_protocol.history_fields(m))
        for index, m in enumerate(body.messages)
    ]
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    request = _input(body, max_tokens, messages=turns, logprobs=body.logprobs,
                     top_logprobs=body.top_logprobs or 0, tools=tool_protocol.tool_messages(body.tools),
                     tool_choice=tool_protocol.tool_choice_message(body.tool_choice),
                     chat_template_kwargs=tool_protocol.template_kwargs_text(body.chat_template_kwargs))
    if body.parallel_tool_calls is not None:
        request.parallel_tool_calls = body.parallel_tool_calls
    return request


def completion_inputs(body: CompletionRequest, max_choices: int) -> list[generation_pb2.GenerateRequest]:
    """One input per prompt (a list of prompts is a batch; choices come prompt by prompt)."""
    refuse_unsupported(body.model_extra, COMPLETIONS)
    if body.echo and body.logprobs is not None:
        raise InvalidRequest("echo with logprobs is not supported (this server has no prompt logprobs); "
                             "send echo or logprobs alone")
    prompts = completion_prompts(body.prompt)
    if not prompts:
        raise InvalidRequest("prompt is empty")
    empty = [index for index, prompt in enumerate(prompts) if not prompt]
    if empty and len(prompts) > 1:  # one prompt alone gets the gRPC API's message
        raise InvalidRequest(f"prompt[{empty[0]}] is empty")
    check_choices(body.n * len(prompts), max_choices)
    return [
        _input(body, body.max_tokens, logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0,
               **({"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}))
        for prompt in prompts
    ]


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a batch: texts, or token-id lists (one list of ints is one prompt)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(token_id, int) for token_id in prompt):
        return [[_int32(token_id) for token_id in prompt]]
    return [p if isinstance(p, str) else [_int32(token_id) for token_id in p] for p in prompt]


def check_choices(num_choices: int, max_choices: int) -> None:
    if not 1 <= num_choices <= max_choices:
        raise InvalidRequest(f"n must give between 1 and {max_choices} choices, got {num_choices}")


def _input(body: _Common, max_tokens: int | None, *, top_logprobs: int, **text) -> generation_pb2.GenerateRequest:
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options needs stream: true (it shapes a streamed answer)")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if (problem := seed_problem(body.seed)) is not None:
        raise InvalidRequest(f"sampling.{problem}")
    sampling = {name: getattr(body, name) for name in generation_pb2.SamplingParams.DESCRIPTOR.fields_by_name}
    sampling["top_k"] = _int32(sampling["top_k"])
    sampling["logit_bias"] = _logit_bias(body.logit_bias)
    request = generation_pb2.GenerateRequest(
        stop=stop,
        stop_token_ids=[_int32(token_id) for token_id in body.stop_token_ids or ()],
        ignore_eos=body.ignore_eos,
        sampling=generation_pb2.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
        top_logprobs=_int32(top_logprobs),
        constraint=constraints.to_proto(constraint_of(body)),
        **text,
    )
    if max_tokens is not None:
        request.max_tokens = _int32(max_tokens)
    return request


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's string keys as token ids (their range is checked with the vocabulary later)."""
    if not bias:
        return None
    ids = {}
    for key, value in bias.items():
        try:
            ids[_int32(int(key))] = value
        except ValueError:
            raise InvalidRequest(f"logit_bias: key {key!r} is not a token id") from None
    return ids


def _int32(value: int | None) -> int | None:
    return None if value is None else min(max(value, INT32_MIN), INT32_MAX)


def constraint_of(body: _Common) -> Constraint | None:
    """The request's output constraint, from `response_format` or one `guided_*` extra."""
    found: list[Constraint] = []
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        found.append(Constraint(ConstraintKind.JSON_OBJECT))
    elif response_format is not None and response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.schema_ is None:
            raise InvalidRequest("response_format.json_schema.schema is required")
        found.append(Constraint(ConstraintKind.JSON_SCHEMA, text=json.dumps(spec.schema_)))
    if body.guided_json is not None:
        schema = body.guided_json if isinstance(body.guided_json, str) else json.dumps(body.guided_json)
        found.append(Constraint(ConstraintKind.JSON_SCHEMA, text=schema))
    if body.guided_regex is not None:
        found.append(Constraint(ConstraintKind.REGEX, text=body.guided_regex))
    if body.guided_choice is not None:
        found.append(Constraint(ConstraintKind.CHOICE, choices=tuple(body.guided_choice)))
    if body.guided_grammar is not None:
        found.append(Constraint(ConstraintKind.GRAMMAR, text=body.guided_grammar))
    if len(found) > 1:
        raise InvalidRequest("give at most one of response_format (json_object, json_schema), "
                             "guided_json, guided_regex, guided_choice and guided_grammar")
    return found[0] if found else None


def _text(content: str | list[TextPart] | None, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    pieces = []
    for part_index, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise InvalidRequest(
                f"messages[{index}].content[{part_index}]: only text parts are supported, got {part.type!r}"
            )
        pieces.append(part.text)
    return "".join(pieces)
