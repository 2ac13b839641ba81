"""OpenAI request bodies and their mapping onto the gateway's `GenerateInput`.

pydantic checks only the JSON types here; every range and rule (temperature in [0, 2], stop
strings, top_logprobs, chat roles...) is checked by `gateway_service.validation`, the same code
the gRPC API goes through. Unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from gateway_service.errors import InvalidRequest
from gateway_service.values import ChatTurn, GenerateInput, SamplingInput

# OpenAI's newer name for the system role.
ROLE_ALIASES = {"developer": "system"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None


class _Common(_Body):
    """Fields both endpoints share, with the extras other servers accept at the top level."""

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

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[str]
    # Completions take the number of alternatives per token here (0 to 20).
    logprobs: int | None = None
    echo: bool = False


Endpoint = Literal["chat", "completions"]


def chat_input(body: ChatCompletionRequest, max_choices: int) -> GenerateInput:
    check_choices(body.n, max_choices)
    turns = tuple(
        ChatTurn(role=ROLE_ALIASES.get(m.role, m.role), content=_text(m.content, index))
        for index, m in enumerate(body.messages)
    )
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _input(body, max_tokens, messages=turns, logprobs=body.logprobs,
                  top_logprobs=body.top_logprobs or 0)


def completion_inputs(body: CompletionRequest, max_choices: int) -> list[GenerateInput]:
    """One input per prompt (a list of prompts is a batch; choices come prompt by prompt)."""
    if body.echo:
        raise InvalidRequest("echo is not supported")
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not prompts:
        raise InvalidRequest("prompt is empty")
    check_choices(body.n * len(prompts), max_choices)
    return [
        _input(body, body.max_tokens, prompt=prompt or None, logprobs=body.logprobs is not None,
               top_logprobs=body.logprobs or 0)
        for prompt in prompts
    ]


def check_choices(num_choices: int, max_choices: int) -> None:
    if not 1 <= num_choices <= max_choices:
        raise InvalidRequest(f"n must give between 1 and {max_choices} choices, got {num_choices}")


def _input(body: _Common, max_tokens: int | None, **text) -> GenerateInput:
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    return GenerateInput(
        max_tokens=max_tokens,
        stop=tuple(stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        sampling=SamplingInput(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            seed=body.seed,
        ),
        request_id=body.user or "",
        **text,
    )


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
