"""What the gateway does with a chat beyond its text: tools, tool choice, template variables and
the reasoning split, decided once per gateway (`ChatFormat`) and checked once per request
(`plan_chat`, which raises `InvalidRequest` naming the field).

tool_choice: `none` renders no tools and parses no calls; `auto` (the default with tools)
renders them, parses calls, and constrains a call the model starts (`tool_grammar`);
`required` and a named function constrain the whole output to calls (of that function).
Harmony's calls under `auto` are parsed, not constrained; a required one is constrained after
the model's analysis (`harmony_grammar`).

Harmony (gpt-oss) is one format for reasoning and calls (`harmony_splitter`): both parsers are
harmony or neither. `auto` on one side follows `harmony` on the other; a template that writes
harmony with the other side set to something else is refused at start.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import jinja2
from jinja2 import meta

from gateway_service import harmony
from gateway_service.errors import InvalidRequest
from gateway_service.harmony_grammar import harmony_call_grammar
from gateway_service.reasoning import AUTO, CLOSE, HARMONY, OPEN, THINK, detect_reasoning
from gateway_service.tagged_arguments import UnsupportedArguments
from gateway_service.tokenizer import Tokenizer
from gateway_service.tool_grammar import tool_call_grammar
from gateway_service.tool_parser_base import ToolCallParser
from gateway_service.tool_parsers import HarmonyParser, tool_parser
from radixserve.constraints import Constraint, ConstraintKind
from radixserve.v1 import generation_pb2

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TEMPLATE_KWARGS_CHARS = 16 * 1024
# Variables the gateway itself passes to apply_chat_template.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "return_dict", "return_tensors", "chat_template", "padding", "truncation",
})
ENABLE_THINKING = "enable_thinking"
# GenerateRequest's and TokenizeRequest's fields that only a chat uses.
CHAT_ONLY_FIELDS = ("tools", "tool_choice", "chat_template_kwargs", "add_generation_prompt")
Mode = generation_pb2.ToolChoiceMode


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """The gateway's chat conventions: its tool-call parser, whether its template renders
    tools itself, how outputs are split into reasoning and content (`think`, `harmony`; None:
    not), and the id of the calls' marker when it is one special token (the grammar names it
    by id), as of the parser's other tags and the reasoning tags that are (`special_tags`)."""

    tool_parser: ToolCallParser
    renders_tools: bool
    reasoning: str | None
    marker_token: int | None = None
    # The variables a request's chat_template_kwargs may set: what the template reads, and
    # enable_thinking when outputs are split at <think> (it turns that split off). None: any (the template
    # could not be read here).
    template_reads: frozenset[str] | None = None
    special_tags: tuple[tuple[str, int], ...] = ()

    @classmethod
    def detect(cls, tokenizer: Tokenizer, tool_parser_name: str, reasoning_parser_name: str) -> "ChatFormat":
        """From the tokenizer's chat template and the flags. Markers that are special tokens
        are kept in the tokenizer's output text, where the parsers look for them."""
        template = tokenizer.chat_template
        parser = tool_parser(tool_parser_name, template)
        reasoning = detect_reasoning(reasoning_parser_name, template)
        if reasoning == HARMONY and tool_parser_name == AUTO:
            parser = HarmonyParser()
        if parser.name == HARMONY and reasoning_parser_name == AUTO:
            reasoning = HARMONY
        if (reasoning == HARMONY) != (parser.name == HARMONY):
            raise ValueError(f"harmony is one format for reasoning and tool calls: --reasoning-parser "
                             f"{reasoning_parser_name} and --tool-call-parser {tool_parser_name} resolve to "
                             f"{reasoning or 'none'} and {parser.name} for this chat template; give both "
                             "harmony (or auto)")
        tags = {THINK: (OPEN, CLOSE), HARMONY: harmony.KEPT_MARKERS}.get(reasoning or "", ())
        special = tuple((tag, token_id) for tag in (*tags, *parser.inner_tags)
                        if (token_id := tokenizer.keep_special(tag)) is not None)
        reads = template_variables(template)
        if reads is not None and reasoning == THINK:
            reads |= {ENABLE_THINKING}
        return cls(parser, "tools" in template, reasoning, tokenizer.keep_special(parser.marker), reads, special)


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """One request's decisions: the tools to render, the template's extra variables, the
    constraint the tools impose (None: none), and what to split out of the output."""

    tools: tuple[generation_pb2.Tool, ...] = ()
    template_kwargs: dict = field(default_factory=dict)
    constraint: Constraint | None = None
    parse_tools: bool = False
    split_reasoning: bool = False


def template_variables(template: str) -> frozenset[str] | None:
    """The variables a chat template reads from its context, found by parsing it as
    transformers compiles it (None where that fails: then no variable is refused)."""
    try:  # transformers' own environment (its extensions, its globals); a private name
        from transformers.utils.chat_template_utils import _compile_jinja_template

        environment = _compile_jinja_template(template).environment
        return frozenset(meta.find_undeclared_variables(environment.parse(template)))
    except (ImportError, jinja2.TemplateError):
        return None


def template_kwargs(text: str, reads: frozenset[str] | None = None) -> dict:
    """`chat_template_kwargs` (a JSON object) as a dict; with `reads` (`ChatFormat.template_reads`),
    a variable outside it is refused: the template would never see it."""
    if not text:
        return {}
    if len(text) > MAX_TEMPLATE_KWARGS_CHARS:
        raise InvalidRequest(f"chat_template_kwargs is longer than {MAX_TEMPLATE_KWARGS_CHARS} characters")
    try:
        kwargs = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"chat_template_kwargs is not valid JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise InvalidRequest("chat_template_kwargs must be a JSON object")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise InvalidRequest(f"chat_template_kwargs.{reserved[0]} is set by the gateway itself")
    unread = sorted(kwargs.keys() - reads) if reads is not None else []
    if unread:
        settable = sorted(reads - RESERVED_TEMPLATE_KWARGS)
        raise InvalidRequest(f"chat_template_kwargs.{unread[0]}: this model's chat template does not read it, so it "
                             f"would change nothing (it reads {', '.join(settable) or 'no variable of yours'})")
    return kwargs


def check_tools(tools, max_chars: int) -> None:
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools, got {len(tools)}")
    names = set()
    for index, tool in enumerate(tools):
        if not TOOL_NAME.fullmatch(tool.name):
            raise InvalidRequest(f"tools[{index}].function.name must be 1 to 64 of [A-Za-z0-9_-], got {tool.name!r}")
        if tool.name in names:
            raise InvalidRequest(f"tools[{index}].function.name {tool.name!r} is given twice")
        names.add(tool.name)
        if tool.parameters:
            try:
                schema = json.loads(tool.parameters)
            except ValueError as exc:
                raise InvalidRequest(f"tools[{index}].function.parameters is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise InvalidRequest(f"tools[{index}].function.parameters must be a JSON object")
    num_chars = sum(len(t.name) + len(t.description) + len(t.parameters) for t in tools)
    if num_chars > max_chars:
        raise InvalidRequest(f"the tools have {num_chars} characters, more than the limit of {max_chars}")


def check_history(messages, max_chars: int) -> None:
    """Calls in assistant turns: named, with a JSON object of arguments, within the limit."""
    num_chars = sum(len(call.name) + len(call.arguments) for turn in messages for call in turn.tool_calls)
    if num_chars > max_chars:
        raise InvalidRequest(f"the messages' tool calls have {num_chars} characters, more than the limit of "
                             f"{max_chars}")
    for index, turn in enumerate(messages):
        if turn.reasoning_content and turn.role != "assistant":
            raise InvalidRequest(f"messages[{index}].reasoning_content: only assistant messages have reasoning")
        if turn.tool_calls and turn.role != "assistant":
            raise InvalidRequest(f"messages[{index}].tool_calls: only assistant messages have tool calls")
        if turn.tool_call_id and turn.role != "tool":
            raise InvalidRequest(f"messages[{index}].tool_call_id: only tool messages answer a call")
        for number, call in enumerate(turn.tool_calls):
            where = f"messages[{index}].tool_calls[{number}]"
            if not call.name:
                raise InvalidRequest(f"{where}.function.name is required")
            try:
                arguments = json.loads(call.arguments) if call.arguments else {}
            except ValueError:
                raise InvalidRequest(f"{where}.function.arguments is not valid JSON") from None
            if not isinstance(arguments, dict):
                raise InvalidRequest(f"{where}.function.arguments must be a JSON object")


def check_chat_only(request: generation_pb2.GenerateRequest | generation_pb2.TokenizeRequest) -> None:
    """The fields that shape a chat's rendering, given with a prompt (which is not rendered):
    refused, where they would be dropped."""
    if request.messages:
        return
    given = [described.name for described, _ in request.ListFields() if described.name in CHAT_ONLY_FIELDS]
    if given:
        raise InvalidRequest(f"{given[0]} needs messages (a chat), not a prompt: a prompt is not "
                             "rendered by the chat template")


def plan_chat(request: generation_pb2.GenerateRequest, chat: ChatFormat, max_chars: int) -> ChatPlan:
    """Check the request's tool and template fields and decide what to do with them."""
    tools = tuple(request.tools)
    choice = request.tool_choice.WhichOneof("choice")
    check_chat_only(request)
    check_tools(tools, max_chars)
    check_history(request.messages, max_chars)
    kwargs = template_kwargs(request.chat_template_kwargs, chat.template_reads)
    # Harmony's split cannot be turned off: its markers would be content.
    split_reasoning = bool(chat.reasoning) and bool(request.messages) and (
        chat.reasoning == HARMONY or kwargs.get(ENABLE_THINKING, True) is not False)
    named = request.tool_choice.function_name if choice == "function_name" else None
    mode = request.tool_choice.mode if choice == "mode" else Mode.TOOL_CHOICE_MODE_AUTO
    if named is not None or mode == Mode.TOOL_CHOICE_MODE_REQUIRED:
        if not tools:
            raise InvalidRequest("tool_choice requires a tool call, but no tools are given")
    if named is not None:
        tools = tuple(t for t in tools if t.name == named)
        if not tools:
            raise InvalidRequest(f"tool_choice names the function {named!r}, which is not among the tools")
    if mode == Mode.TOOL_CHOICE_MODE_NONE or not tools:
        return ChatPlan((), kwargs, None, False, split_reasoning)
    if request.constraint.WhichOneof("kind") is not None:
        raise InvalidRequest("give either tools or a structured-output constraint (response_format, "
                             "guided_*), not both; or set tool_choice to none")
    required = named is not None or mode == Mode.TOOL_CHOICE_MODE_REQUIRED
    if isinstance(chat.tool_parser, HarmonyParser):  # a required call is constrained, auto ones parsed
        grammar = harmony_call_grammar(tools, dict(chat.special_tags)) if required else None
        constraint = None if grammar is None else Constraint(ConstraintKind.GRAMMAR, text=grammar)
        return ChatPlan(tuple(request.tools), kwargs, constraint, True, split_reasoning)
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    # A named function renders all the tools (the model sees its whole toolbox); it may call only
    # that one.
    try:
        grammar = tool_call_grammar(chat.tool_parser, tools, required, parallel, chat.marker_token,
                                    dict(chat.special_tags))
    except UnsupportedArguments as exc:
        raise InvalidRequest(f"tools: {exc} (the {chat.tool_parser.name} call layout)") from None
    return ChatPlan(tuple(request.tools), kwargs, Constraint(ConstraintKind.GRAMMAR, text=grammar),
                    True, split_reasoning)
