"""A chat request as the chat template's input: messages (with tool calls and tool results in
history) and tool definitions in the layout transformers' `apply_chat_template(tools=...)` takes.

Templates that cannot render tools (they never mention `tools`, as SmolLM2's) get the same
information as plain chat turns instead, so that no tool is silently dropped: the definitions
and the call layout of the gateway's parser go into the system message (appended to the
caller's, or a new first message), an assistant's calls become its text in that layout, and a
tool result becomes a user turn wrapped in `<tool_response>` tags.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from gateway_service.tool_parser_base import ToolCallParser
from radixserve.v1 import generation_pb2

ChatMessage = generation_pb2.ChatMessage
Tool = generation_pb2.Tool

EXAMPLE_CALL = ("<function-name>", {"<argument>": "<value>"})


def openai_tool(tool: Tool) -> dict:
    """A tool as OpenAI's (and transformers' templates') function definition."""
    function: dict = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = json.loads(tool.parameters) if tool.parameters else {"type": "object"}
    return {"type": "function", "function": function}


def template_input(
    turns: Sequence[ChatMessage], tools: Sequence[Tool], renders_tools: bool, parser: ToolCallParser
) -> tuple[list[dict], list[dict] | None]:
    """`(messages, tools)` for `apply_chat_template`; tools is None when there are none or the
    template cannot render them (then they are in the messages)."""
    if renders_tools:
        return [_template_message(turn) for turn in turns], [openai_tool(t) for t in tools] or None
    messages = [_plain_message(turn, parser) for turn in turns]
    if tools:
        instructions = tool_instructions(tools, parser)
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{instructions}"
        else:
            messages.insert(0, {"role": "system", "content": instructions})
    return messages, None


def tool_instructions(tools: Sequence[Tool], parser: ToolCallParser) -> str:
    """The system text that describes `tools` to a model whose template cannot."""
    definitions = "\n".join(json.dumps(openai_tool(tool)) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more of these functions (JSON schemas):\n"
        f"<tools>\n{definitions}\n</tools>\n\n"
        "To call functions, answer with nothing but the calls, each written as:\n"
        f"{parser.render_calls([EXAMPLE_CALL])}"
    )


def _arguments(call: generation_pb2.ToolCall) -> dict:
    return json.loads(call.arguments) if call.arguments else {}


def _template_message(turn: ChatMessage) -> dict:
    message: dict = {"role": turn.role, "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": _arguments(call)}}
            for call in turn.tool_calls
        ]
    if turn.tool_call_id:
        message["tool_call_id"] = turn.tool_call_id
    if turn.name:
        message["name"] = turn.name
    return message | _reasoning(turn)


def _reasoning(turn: ChatMessage) -> dict:
    """An echoed turn's reasoning under both names templates read it by (Qwen3's, gpt-oss's)."""
    if not turn.reasoning_content:
        return {}
    return {"reasoning_content": turn.reasoning_content, "thinking": turn.reasoning_content}


def _plain_message(turn: ChatMessage, parser: ToolCallParser) -> dict:
    if turn.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{turn.content}\n</tool_response>"}
    content = turn.content
    if turn.tool_calls:
        calls = parser.render_calls([(call.name, _arguments(call)) for call in turn.tool_calls])
        content = f"{content}\n{calls}" if content else calls
    return {"role": turn.role, "content": content} | _reasoning(turn)
