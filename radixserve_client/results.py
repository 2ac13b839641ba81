"""What the client returns.

`Chunk` and `GenerateResult` are the client's own: the finish reason as a string ("stop",
"length", "cancelled"; None before the last chunk, where the proto has an enum whose 0 means
"not yet"), usage None until the last chunk, and a whole result joined from the stream. Everything
inside them that the public proto already describes is the proto message itself: `TokenLogprob`,
`TopLogprob`, `Usage` and `ModelInfo` are `radixserve.v1.generation_pb2` classes, read like
dataclasses (attribute access), so there is no second declaration of their fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.finish_reason import finish_reason_text
from radixserve.v1 import generation_pb2

TokenLogprob = generation_pb2.TokenLogprob
TopLogprob = generation_pb2.TopLogprob
Usage = generation_pb2.Usage
ModelInfo = generation_pb2.GetModelInfoResponse



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


def chunk_from_proto(response: generation_pb2.GenerateResponse) -> Chunk:
    return Chunk(
        text=response.text,
        token_ids=list(response.token_ids),
        logprobs=list(response.logprobs),
        finish_reason=finish_reason_text(response.finish_reason),
        usage=response.usage if response.HasField("usage") else None,
    )


def join_chunks(chunks: list[Chunk]) -> GenerateResult:
    """The whole result of a finished stream."""
    last = next((chunk for chunk in reversed(chunks) if chunk.usage is not None), None)
    return GenerateResult(
        text="".join(chunk.text for chunk in chunks),
        token_ids=[token for chunk in chunks for token in chunk.token_ids],
        finish_reason=next((c.finish_reason for c in reversed(chunks) if c.finish_reason is not None), None),
        usage=last.usage if last is not None else Usage(),
        logprobs=[logprob for chunk in chunks for logprob in chunk.logprobs],
    )
