"""Building a GenerateRequest or an EmbedRequest from arguments (shared by both clients)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from radixserve.v1 import generation_pb2

Message = Mapping[str, str] | tuple[str, str]


def chat_messages(messages: Iterable[Message]) -> list[generation_pb2.ChatMessage]:
    """Messages as `{"role": ..., "content": ...}` mappings or `(role, content)` pairs."""
    result = []
    for message in messages:
        if isinstance(message, Mapping):
            role, content = message["role"], message["content"]
        else:
            role, content = message
        result.append(generation_pb2.ChatMessage(role=role, content=content))
    return result


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
