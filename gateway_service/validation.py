"""Request validation: every mistake a caller can make becomes an `InvalidRequest` that names
the field, before anything reaches a router. Requests are the `GenerateRequest` message itself
(the HTTP API builds one too); sampling ranges are `radixserve.sampling.RANGES`, the same
declaration the router and the workers check with.

Validation runs in two steps because some limits need the tokenized prompt: `check_input`
before tokenization (cheap checks on sizes first, so an oversized request costs nothing more),
`resolve_max_tokens` after it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gateway_service.errors import InvalidRequest
from gateway_service.known_fields import check_known_fields
from radixserve.flags import check, setting
from radixserve.sampling import MAX_TOP_LOGPROBS, SamplingParams, logit_bias_problems
from radixserve.v1 import generation_pb2

CHAT_ROLES = ("system", "user", "assistant", "tool")
# Roles whose message is pointless without content; an assistant turn may be empty.
CONTENT_REQUIRED_ROLES = ("system", "user", "tool")
# Stop strings are matched against every new piece of text: bound the work per token.
MAX_STOP_STRINGS = 32
MAX_STOP_LEN = 512
# Stop token ids are checked against every sampled token.
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on what one public request may hold (the gateway's flags, named after the fields).

    `max_request_bytes` is enforced by gRPC itself (its maximum receive size) and by the HTTP API
    while the body streams in, as `http_body_timeout_s` is (gRPC's own deadline and keepalive
    bound a stalled message there); the others here.
    """

    max_request_bytes: int = setting(4 * 1024 * 1024, "largest request accepted: gRPC's receive limit "
                                     "on the public port (larger messages get RESOURCE_EXHAUSTED "
                                     "before they are read) and the HTTP body limit (413 as soon as "
                                     "it is passed)", min=1)
    max_prompt_chars: int = setting(131072, "characters of a prompt, or of all messages' roles and "
                                    "contents together (Generate and Tokenize)", min=1)
    max_prompt_tokens: int = setting(0, "prompt tokens after the chat template (0: the model's "
                                     "context length); bounds Tokenize's result too", min=0)
    max_messages: int = setting(256, "messages in one chat request", min=1)
    max_request_id_len: int = setting(128, "characters of a caller's request_id (printable ASCII)",
                                      min=1)
    max_user_chars: int = setting(256, "characters of OpenAI's `user` field (an end-user id, any "
                                  "Unicode, logged with the request)", min=1)
    http_body_timeout_s: float = setting(30.0, "seconds an HTTP request's body may take to arrive whole "
                                         "once its head has (a body that stalls, or dribbles, is 408 and "
                                         "its connection is closed)", above=0)

    def __post_init__(self) -> None:
        check(self)


def check_text_input(request: generation_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """Exactly one of prompt and messages, within the size limits; a well-formed chat."""
    if len(request.messages) > limits.max_messages:
        raise InvalidRequest(f"at most {limits.max_messages} messages, got {len(request.messages)}")
    num_chars = len(request.prompt) + sum(len(t.role) + len(t.content) + len(t.reasoning_content)
                                          for t in request.messages)
    if num_chars > limits.max_prompt_chars:
        raise InvalidRequest(
            f"the prompt has {num_chars} characters, more than the limit of {limits.max_prompt_chars}"
        )
    token_ids = getattr(request, "prompt_token_ids", ())  # a Tokenize request has none
    if request.prompt and request.messages:
        raise InvalidRequest("give either prompt or messages, not both")
    if token_ids and (request.prompt or request.messages):
        raise InvalidRequest("give prompt_token_ids alone, without prompt or messages")
    if not request.prompt and not request.messages and not token_ids:
        raise InvalidRequest("prompt or messages is required (both are empty)")
    for index, turn in enumerate(request.messages):
        if turn.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"messages[{index}].role: unknown role {turn.role!r} (use one of {', '.join(CHAT_ROLES)})"
            )
        if turn.role in CONTENT_REQUIRED_ROLES and not turn.content:
            raise InvalidRequest(f"messages[{index}].content: empty content in a {turn.role} message")


def check_request_id(request_id: str, limits: RequestLimits) -> None:
    """Short printable ASCII: it is echoed in logs, and travels with the request to the router."""
    if len(request_id) > limits.max_request_id_len:
        raise InvalidRequest(f"request_id is longer than {limits.max_request_id_len} characters")
    if request_id and not (request_id.isascii() and request_id.isprintable()):
        raise InvalidRequest("request_id must be printable ASCII")


def check_user(user: str, limits: RequestLimits) -> None:
    """OpenAI's end-user id: any text, bounded (it is logged)."""
    if len(user) > limits.max_user_chars:
        raise InvalidRequest(f"user is longer than {limits.max_user_chars} characters")


def check_prompt_tokens(num_tokens: int, context_len: int | None, limits: RequestLimits,
                        what: str = "the prompt") -> None:
    """The tokenized prompt (or Tokenize input, or Detokenize's `token_ids`: `what` names it)
    within --max-prompt-tokens, else the context (when known)."""
    limit = limits.max_prompt_tokens or context_len
    if limit is not None and num_tokens > limit:
        raise InvalidRequest(f"{what} has {num_tokens} tokens, more than the limit of {limit}")


def check_prompt_token_ids(token_ids, vocab_size: int, name: str = "prompt_token_ids") -> None:
    """Token ids given by the caller, each in the vocabulary."""
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(f"{name}[{index}] = {token_id} is outside the vocabulary [0, {vocab_size})")


def check_input(request: generation_pb2.GenerateRequest, vocab_size: int, limits: RequestLimits) -> None:
    """Everything that can be checked before tokenizing, sizes first."""
    check_known_fields(request)
    check_request_id(request.request_id, limits)
    check_text_input(request, limits)
    check_prompt_token_ids(request.prompt_token_ids, vocab_size)
    if request.HasField("max_tokens") and request.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be >= 1, got {request.max_tokens}")
    if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs}"
        )
    if request.top_logprobs > 0 and not request.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true")
    if len(request.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(request.stop)}")
    for index, stop in enumerate(request.stop):
        if not stop:
            raise InvalidRequest(f"stop[{index}] is empty")
        if len(stop) > MAX_STOP_LEN:
            raise InvalidRequest(f"stop[{index}] is longer than {MAX_STOP_LEN} characters")
    if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(request.stop_token_ids)}"
        )
    for index, token_id in enumerate(request.stop_token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(
                f"stop_token_ids[{index}] = {token_id} is outside the vocabulary [0, {vocab_size})"
            )


# The public API's defaults (generation.proto): temperature 1, everything else off.
PUBLIC_DEFAULTS = SamplingParams(temperature=1.0)
# vLLM's top_k that keeps every token (as 0 does).
VLLM_TOP_K_OFF = -1
# The optional fields of the public SamplingParams; each has a SamplingParams field of its name.
# (logit_bias, a map, is not optional: it is resolved on its own.)
SAMPLING_FIELDS = tuple(field.name for field in generation_pb2.SamplingParams.DESCRIPTOR.fields
                        if field.name != "logit_bias")


def resolve_sampling(
    sampling: generation_pb2.SamplingParams, vocab_size: int, logprobs: bool = False, top_logprobs: int = 0
) -> SamplingParams:
    """Fill the unset fields with the public defaults and check every value's range.

    top_k larger than the vocabulary means "keep everything", so it is clamped; -1 is vLLM's
    other way of saying it (its clients send it), so it is 0, off.
    """
    given = {name: getattr(sampling, name) for name in SAMPLING_FIELDS if sampling.HasField(name)}
    if given.get("top_k") == VLLM_TOP_K_OFF:
        given["top_k"] = 0
    params = replace(PUBLIC_DEFAULTS, **given, logprobs=logprobs, top_logprobs=top_logprobs,
                     logit_bias=tuple(sorted(sampling.logit_bias.items())))
    problems = params.problems() + logit_bias_problems(params.logit_bias, vocab_size)
    if problems:
        raise InvalidRequest(f"sampling.{problems[0]}")
    return replace(params, top_k=min(params.top_k, vocab_size))


def resolve_max_tokens(
    requested: int | None, prompt_len: int, context_len: int, default_max_tokens: int
) -> int:
    """The number of tokens to ask the router for.

    An explicit max_tokens must fit in the context with the prompt; an unset one is the
    gateway's default, capped to what the context leaves.
    """
    if prompt_len < 1:
        raise InvalidRequest("the prompt encodes to no tokens")
    room = context_len - prompt_len
    if room < 1:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens, which leaves no room in the model's "
            f"context of {context_len} tokens"
        )
    if requested is None:
        return min(default_max_tokens, room)
    if requested > room:
        raise InvalidRequest(
            f"prompt ({prompt_len} tokens) + max_tokens ({requested}) exceeds the model's "
            f"context of {context_len} tokens"
        )
    return requested
