"""OpenAI's tool-calling shapes (tools, tool_choice, calls in history, chat_template_kwargs) and
their mapping onto the public messages (`Tool`, `ToolChoice`, `ToolCall`).

pydantic checks the JSON types; names, schemas and combinations are checked by
`gateway_service.chat_format`, the same code the gRPC API goes through.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from radixserve.v1 import generation_pb2

MODES = {
    "auto": generation_pb2.TOOL_CHOICE_MODE_AUTO,
    "none": generation_pb2.TOOL_CHOICE_MODE_NONE,
    "required": generation_pb2.TOOL_CHOICE_MODE_REQUIRED,
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Body):
    name: str
    # OpenAI sends a JSON text; some clients send the object itself.
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # Calls always follow the schema (the grammar): strict or not is the same here.
    strict: bool | None = None


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoiceIn = Literal["auto", "none", "required"] | NamedToolChoice


def tool_messages(tools: list[ToolDefinition] | None) -> list[generation_pb2.Tool]:
    return [
        generation_pb2.Tool(
            name=tool.function.name, description=tool.function.description or "",
            parameters=json.dumps(tool.function.parameters) if tool.function.parameters is not None else "",
        )
        for tool in tools or ()
    ]


def tool_choice_message(choice: ToolChoiceIn | None) -> generation_pb2.ToolChoice | None:
    if choice is None:
        return None
    if isinstance(choice, str):
        return generation_pb2.ToolChoice(mode=MODES[choice])
    return generation_pb2.ToolChoice(function_name=choice.function.name)


def call_messages(calls: list[ToolCallIn] | None) -> list[generation_pb2.ToolCall]:
    return [
        generation_pb2.ToolCall(
            index=index, id=call.id or "", name=call.function.name,
            arguments=call.function.arguments if isinstance(call.function.arguments, str)
            else json.dumps(call.function.arguments),
        )
        for index, call in enumerate(calls or ())
    ]


def history_fields(message: Any) -> dict:
    """A chat message's tool fields (`tool_calls`, `tool_call_id`, `name`) as `ChatMessage` fields."""
    return {"tool_calls": call_messages(message.tool_calls), "tool_call_id": message.tool_call_id or "",
            "name": message.name or ""}


def template_kwargs_text(kwargs: dict[str, Any] | None) -> str:
    return "" if not kwargs else json.dumps(kwargs)
