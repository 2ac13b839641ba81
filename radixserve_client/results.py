"""What the client returns: plain dataclasses, no protobuf."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.v1 import generation_pb2

_FINISH_NAMES = {
    generation_pb2.FINISH_REASON_STOP: "stop",
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_CANCELLED: "cancelled",
}


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
    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed response: new text and token ids; the last also has finish reason and usage."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None  # "stop", "length", "cancelled"; None before the last chunk
    usage: Usage | None


@dataclass(frozen=True, slots=True)
class GenerateResult:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage
    logprobs: list[TokenLogprob]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_name: str
    context_len: int
    tp_size: int
    page_size: int
    dtype: str
    num_pages: int


def chunk_from_proto(response: generation_pb2.GenerateResponse) -> Chunk:
    return Chunk(
        text=response.text,
        token_ids=list(response.token_ids),
        logprobs=[
            TokenLogprob(
                token_id=lp.token_id,
                token=lp.token,
                logprob=lp.logprob,
                top_logprobs=[TopLogprob(t.token_id, t.token, t.logprob) for t in lp.top_logprobs],
            )
            for lp in response.logprobs
        ],
        finish_reason=_FINISH_NAMES.get(response.finish_reason),
        usage=(
            Usage(
                response.usage.prompt_tokens,
                response.usage.completion_tokens,
                response.usage.cached_tokens,
            )
            if response.HasField("usage") else None
        ),
    )


class ResultBuilder:
    """Joins chunks into one result."""

    def __init__(self) -> None:
        self._texts: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._finish_reason: str | None = None
        self._usage = Usage()

    def add(self, chunk: Chunk) -> None:
        self._texts.append(chunk.text)
        self._token_ids.extend(chunk.token_ids)
        self._logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self._finish_reason = chunk.finish_reason
        if chunk.usage is not None:
            self._usage = chunk.usage

    def result(self) -> GenerateResult:
        return GenerateResult(
            text="".join(self._texts),
            token_ids=self._token_ids,
            finish_reason=self._finish_reason,
            usage=self._usage,
            logprobs=self._logprobs,
        )


def model_info_from_proto(reply: generation_pb2.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model_name=reply.model_name,
        context_len=reply.context_len,
        tp_size=reply.tp_size,
        page_size=reply.page_size,
        dtype=reply.dtype,
        num_pages=reply.num_pages,
    )
