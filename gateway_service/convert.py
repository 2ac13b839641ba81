"""The mapping between protobuf messages and the gateway's plain values, both ways."""

from __future__ import annotations

from radixserve import constraints, sampling
from radixserve.v1 import generation_pb2, router_pb2

from gateway_service.values import (
    ChatTurn,
    FinishReason,
    GenerateInput,
    OutputChunk,
    RouterRequest,
    SamplingInput,
    ServerInfo,
    TokenLogprob,
    TopLogprob,
    Usage,
)

_FINISH_TO_PROTO = {
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: generation_pb2.FINISH_REASON_CANCELLED,
}
_FINISH_FROM_PROTO = {value: key for key, value in _FINISH_TO_PROTO.items()}

_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seed",
)


def sampling_input(message: generation_pb2.SamplingParams) -> SamplingInput:
    """Optional proto3 fields: unset stays None, an explicit 0 stays 0."""
    values = {
        name: getattr(message, name) if message.HasField(name) else None
        for name in _SAMPLING_FIELDS
    }
    return SamplingInput(**values)


def chat_turns(messages) -> tuple[ChatTurn, ...]:
    return tuple(ChatTurn(role=m.role, content=m.content) for m in messages)


def generate_input(request: generation_pb2.GenerateRequest) -> GenerateInput:
    return GenerateInput(
        prompt=request.prompt or None,
        messages=chat_turns(request.messages),
        max_tokens=request.max_tokens if request.HasField("max_tokens") else None,
        stop=tuple(request.stop),
        stop_token_ids=tuple(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        sampling=sampling_input(request.sampling),
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
        request_id=request.request_id,
        constraint=constraints.from_proto(request.constraint),
    )


def tokenize_input(request: generation_pb2.TokenizeRequest) -> GenerateInput:
    return GenerateInput(prompt=request.prompt or None, messages=chat_turns(request.messages))


def router_request(request: RouterRequest) -> router_pb2.RouterGenerateRequest:
    return router_pb2.RouterGenerateRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling=sampling.to_proto(request.sampling),
        max_tokens=request.max_tokens,
        stop_token_ids=list(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        constraint=constraints.to_proto(request.constraint),
    )


def server_info(reply: router_pb2.GetServerInfoResponse) -> ServerInfo:
    return ServerInfo(
        model_name=reply.model_name,
        context_len=reply.context_len,
        tp_size=reply.tp_size,
        page_size=reply.page_size,
        dtype=reply.dtype,
        num_pages=reply.num_pages,
        eos_token_ids=tuple(reply.eos_token_ids),
        vocab_size=reply.vocab_size,
    )


def model_info_reply(info: ServerInfo) -> generation_pb2.GetModelInfoResponse:
    return generation_pb2.GetModelInfoResponse(
        model_name=info.model_name,
        context_len=info.context_len,
        tp_size=info.tp_size,
        page_size=info.page_size,
        dtype=info.dtype,
        num_pages=info.num_pages,
    )


def finish_reason(value: int) -> FinishReason | None:
    """The router's finish reason; None while the request is still running."""
    return _FINISH_FROM_PROTO.get(value)


def usage(message: generation_pb2.Usage) -> Usage:
    return Usage(
        prompt_tokens=message.prompt_tokens,
        completion_tokens=message.completion_tokens,
        cached_tokens=message.cached_tokens,
    )


def raw_logprobs(messages) -> list[TokenLogprob]:
    """The router's logprobs, still without token text (the gateway fills it in)."""
    return [
        TokenLogprob(
            token_id=m.token_id,
            token=m.token,
            logprob=m.logprob,
            top_logprobs=tuple(
                TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob)
                for t in m.top_logprobs
            ),
        )
        for m in messages
    ]


def generate_response(chunk: OutputChunk) -> generation_pb2.GenerateResponse:
    response = generation_pb2.GenerateResponse(
        text=chunk.text,
        token_ids=chunk.token_ids,
        logprobs=[
            generation_pb2.TokenLogprob(
                token_id=lp.token_id,
                token=lp.token,
                logprob=lp.logprob,
                top_logprobs=[
                    generation_pb2.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob)
                    for t in lp.top_logprobs
                ],
            )
            for lp in chunk.logprobs
        ],
    )
    if chunk.finish_reason is not None:
        response.finish_reason = _FINISH_TO_PROTO[chunk.finish_reason]
    if chunk.usage is not None:
        response.usage.CopyFrom(
            generation_pb2.Usage(
                prompt_tokens=chunk.usage.prompt_tokens,
                completion_tokens=chunk.usage.completion_tokens,
                cached_tokens=chunk.usage.cached_tokens,
            )
        )
    return response
