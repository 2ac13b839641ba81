"""OpenAI and vLLM request fields this server does not implement, refused where they would
change the answer.

A client that sends one of these expects something we would not do (call legacy `functions`,
speak audio, keep the stop string, continue the last assistant message, at least N tokens...),
or sends one endpoint's field to the other (`tools` or `chat_template_kwargs` to
/v1/completions, `prompt` to /v1/chat/completions): answering 200 without it would be a silent
wrong answer, so each is a 400 naming the field and, where there is one, what to send instead.
A value that asks for what the server does anyway (`modalities: ["text"]`,
`skip_special_tokens: true`, `best_of: 1`) passes. Fields that change nothing in the output
(`HARMLESS`: `store`, `metadata`, `service_tier`, `prediction`...; in an echoed assistant message
its `annotations`) are accepted and not used; its `reasoning_content` (or `reasoning`) goes to
the chat template (`chat_render`). Any other field the body
does not declare is a 400 too, as OpenAI answers "Unrecognized request argument": a typo
(`max_token`) or another server's extra (`repetition_penalty_range`, `regex`) would otherwise
be a 200 that dropped it. A field sent as null asks for nothing and passes.

The request bodies keep the fields they do not declare (`model_extra`); `refuse_unsupported`
reads them there, so this module is the one place a field is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway_service.errors import InvalidRequest

CHAT, COMPLETIONS = "chat", "completions"
BOTH = (CHAT, COMPLETIONS)
# A chat message's own fields (`messages[i].<field>`).
MESSAGE = "message"
# The bodies of /v1/embeddings, /tokenize and /detokenize: only HARMLESS fields besides theirs.
EMBEDDINGS, TOKENIZE, DETOKENIZE = "embeddings", "tokenize", "detokenize"

# Undeclared fields accepted and not used: they change nothing in what the server answers.
_ACCOUNTING = frozenset({"store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"})
HARMLESS = {
    CHAT: _ACCOUNTING | {"prediction"},  # a predicted output only speeds up what it matches
    COMPLETIONS: _ACCOUNTING,
    # What an OpenAI-style answer holds and a client sends back in the history; the chat
    # template is given the turn's content, reasoning and tool calls.
    MESSAGE: frozenset({"annotations"}),
    EMBEDDINGS: _ACCOUNTING,
    TOKENIZE: frozenset(),
    DETOKENIZE: frozenset(),
}


@dataclass(frozen=True, slots=True)
class Unsupported:
    name: str
    endpoints: tuple[str, ...]
    # Whether the value asks for something this server does not do (None never does).
    asks: Callable[[Any], bool]
    instead: str = ""


def _set(value: Any) -> bool:
    return value not in (None, False, "", [], {})


def _given(value: Any) -> bool:
    return value is not None


def _not(default: Any) -> Callable[[Any], bool]:
    return lambda value: value is not None and value != default


_CHAT_ROUTE = "it is a field of /v1/chat/completions"

FIELDS = (
    Unsupported("functions", (CHAT,), _set, "send them as tools"),
    Unsupported("function_call", (CHAT,), _set, "use tool_choice"),
    Unsupported("audio", (CHAT,), _set, "this server answers in text only"),
    Unsupported("modalities", (CHAT,), lambda value: value is not None and value != ["text"],
                "this server answers in text only"),
    Unsupported("web_search_options", (CHAT,), _given),
    Unsupported("continue_final_message", (CHAT,), _set),
    Unsupported("add_generation_prompt", (CHAT,), _not(True)),
    Unsupported("echo", (CHAT,), _set),
    Unsupported("documents", (CHAT,), _set),
    Unsupported("suffix", BOTH, _set),
    Unsupported("best_of", BOTH, _not(1), "use n"),
    Unsupported("use_beam_search", BOTH, _set),
    Unsupported("length_penalty", BOTH, _not(1)),
    Unsupported("min_tokens", BOTH, _not(0)),
    Unsupported("prompt_logprobs", BOTH, _given),
    Unsupported("include_stop_str_in_output", BOTH, _set),
    Unsupported("skip_special_tokens", BOTH, _not(True)),
    Unsupported("spaces_between_special_tokens", BOTH, _not(True)),
    Unsupported("allowed_token_ids", BOTH, _set, "use logit_bias"),
    Unsupported("bad_words", BOTH, _set, "use logit_bias"),
    Unsupported("truncate_prompt_tokens", BOTH, _given),
    Unsupported("structured_outputs", BOTH, _set, "use response_format or guided_json, guided_regex, "
                "guided_choice, guided_grammar"),
    Unsupported("guided_whitespace_pattern", BOTH, _set),
    Unsupported("return_tokens_as_token_ids", BOTH, _set),
    Unsupported("add_special_tokens", (CHAT,), _not(False), "the rendered template holds its special tokens"),
    Unsupported("add_special_tokens", (COMPLETIONS,), _not(True)),
    Unsupported("function_call", (MESSAGE,), _set, "send tool_calls"),
    Unsupported("audio", (MESSAGE,), _set, "this server reads text only"),
    Unsupported("refusal", (MESSAGE,), _set, "put it in content"),
    # One endpoint's fields sent to the other.
    Unsupported("prompt", (CHAT,), _given, "a chat takes messages"),
    Unsupported("messages", (COMPLETIONS,), _given, _CHAT_ROUTE),
    Unsupported("tools", (COMPLETIONS,), _set, _CHAT_ROUTE),
    Unsupported("tool_choice", (COMPLETIONS,), _set, _CHAT_ROUTE),
    Unsupported("chat_template_kwargs", (COMPLETIONS,), _set, f"a prompt has no chat template; {_CHAT_ROUTE}"),
    Unsupported("max_completion_tokens", (COMPLETIONS,), _given, "use max_tokens"),
    Unsupported("top_logprobs", (COMPLETIONS,), _given,
                "completions take the number of alternatives in logprobs"),
)
_BY_NAME = {(field.name, endpoint): field for field in FIELDS for endpoint in field.endpoints}


def refuse_unsupported(extra: Mapping[str, Any] | None, endpoint: str, where: str = "") -> None:
    """`InvalidRequest` naming the first field of `extra` (a body's or, for `MESSAGE`, a chat
    message's undeclared fields) that asks for something this server does not do on `endpoint`,
    or that it does not know (not null, not `HARMLESS`); `where` goes before the field's name
    (`messages[2].`)."""
    for name, value in (extra or {}).items():
        field = _BY_NAME.get((name, endpoint))
        if field is None:
            if value is None or name in HARMLESS[endpoint]:
                continue
            raise InvalidRequest(f"{where}{name} is not a field this server knows (unrecognized request "
                                 f"argument); it would be ignored, so it is refused")
        if not field.asks(value):
            continue
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
        hint = f"; {field.instead}" if field.instead else ""
        raise InvalidRequest(f"{where}{name} ({shown}) is not supported by this server{hint}")
