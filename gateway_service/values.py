"""Plain values the gateway works with; protobuf stays in `convert`."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from radixserve.constraints import Constraint
from radixserve.sampling import SamplingParams


class FinishReason(Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class ChatTurn:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class SamplingInput:
    """Sampling options as the caller sent them: None means unset (use the default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """A Generate or Tokenize request as received, before validation.

    `prompt` is None when the caller left it empty; `messages` is empty when none were sent.
    """

    prompt: str | None = None
    messages: tuple[ChatTurn, ...] = ()
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling: SamplingInput = field(default_factory=SamplingInput)
    logprobs: bool = False
    top_logprobs: int = 0
    request_id: str = ""
    constraint: Constraint | None = None


@dataclass(frozen=True, slots=True)
class RouterRequest:
    """What the gateway asks a router for: validated, tokenized, every default resolved."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams  # logprobs and top_logprobs included
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    constraint: Constraint | None = None  # checked: it compiles


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What a router reports about the model replica behind it."""

    model_name: str
    context_len: int
    tp_size: int
    page_size: int
    dtype: str
    num_pages: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class OutputChunk:
    """One response of the gateway's stream: new text and the token ids it came from.

    `finish_reason` and `usage` are set on the last chunk only.
    """

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
