"""How the tagged call layouts (`tool_parsers_tagged`) write each argument of a tool, read from its
parameters schema: one reading, shared by the grammar that constrains the calls
(`tool_grammar_layouts`) and the parser that reads them back, so that what one writes the other
reads as the same value.

A tagged layout writes an argument as text between two tags, with no quotes to tell a string
from a number. So a parameter is one of:

- **raw text**: a plain string (`type: string`, or an `enum`/`const` of strings, with at most
  `minLength`/`maxLength` up to `RAW_MAX_LENGTH` and annotations): its value is the text between
  the tags, as the templates write a string. Read back as that text, even where it spells a
  number ("42");
- **JSON**: everything else (numbers, booleans, objects, arrays, unions, and strings with a
  `pattern`, a `format` or a longer length bound, which only a JSON string's grammar enforces:
  the grammar library runs out of its work limit on a raw text's lexeme counting past about
  2,500 characters): its value is a JSON text, read back with `json.loads`.

The arguments are the schema's `properties` in their order, the `required` ones always and the
others where the model writes them; a schema without `properties` takes any keys, each value
read as the parser reads an unknown one (`tool_parsers_tagged.text_value`). Keywords that bind
the object as a whole (`anyOf` at its top, `minProperties`, ...) cannot be enforced on pairs of
tags: such a tool is refused by name (`UnsupportedArguments`), never served unchecked.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.v1 import generation_pb2

ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly"})
RAW_STRING_KEYS = ANNOTATIONS | {"type", "enum", "const", "minLength", "maxLength"}
# What a parameters schema may say at its top besides its properties.
OBJECT_KEYS = ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "$defs", "definitions",
                             "$schema", "$id", "strict"}
DEFINITIONS = ("$defs", "definitions")
# The longest length bound a raw text value is written under (its lexeme counts the characters).
RAW_MAX_LENGTH = 2048
# Property names a layout can write between its tags (no tag characters, quotes or line breaks).
FORBIDDEN_IN_NAMES = frozenset('<>"\n\r')


class UnsupportedArguments(ValueError):
    """A tool's parameters schema says what a tagged layout cannot enforce (the message names it)."""


@dataclass(frozen=True, slots=True)
class Argument:
    """One parameter: its name, whether it must be written, and how its value is written
    (`raw`: the text itself, with `choices`/lengths; otherwise `schema`, a JSON value)."""

    name: str
    required: bool
    raw: bool
    schema: dict
    choices: tuple[str, ...] | None = None
    min_length: int = 0
    max_length: int | None = None

    def read(self, text: str) -> object:
        """The value the text between the tags stands for."""
        return text if self.raw else json.loads(text)


@dataclass(frozen=True, slots=True)
class ToolArguments:
    """A tool's parameters as the tagged layouts write them; `open`: any keys (no properties)."""

    name: str
    arguments: tuple[Argument, ...]
    open: bool

    def argument(self, key: str) -> Argument | None:
        return next((argument for argument in self.arguments if argument.name == key), None)


def tool_arguments(tool: generation_pb2.Tool) -> ToolArguments:
    """How `tool`'s arguments are written; raises `UnsupportedArguments` naming what cannot be."""
    schema = json.loads(tool.parameters) if tool.parameters else {}
    where = f"the parameters of {tool.name!r}"
    extra = sorted(set(schema) - OBJECT_KEYS)
    if extra:
        raise UnsupportedArguments(f"{where} use {extra[0]!r} at the top, which a call written as tagged "
                                   "arguments cannot enforce")
    if schema.get("type", "object") != "object":
        raise UnsupportedArguments(f"{where} must be an object schema (type 'object')")
    properties = schema.get("properties") or {}
    required = list(schema.get("required") or [])
    if not isinstance(properties, dict) or not all(isinstance(name, str) for name in required):
        raise UnsupportedArguments(f"{where} have malformed properties or required")
    definitions = {key: schema[key] for key in DEFINITIONS if key in schema}
    arguments = []
    for name in [*properties, *(name for name in required if name not in properties)]:
        property_schema = properties.get(name, True)
        if property_schema is False:
            if name in required:
                raise UnsupportedArguments(f"{where} require {name!r}, whose schema is false")
            continue
        if set(name) & FORBIDDEN_IN_NAMES or name != name.strip() or not name:
            raise UnsupportedArguments(f"{where} have a property name a tagged call cannot write: {name!r}")
        arguments.append(_argument(name, name in required, {} if property_schema is True else property_schema,
                                   definitions))
    return ToolArguments(tool.name, tuple(arguments), open=not properties)


def arguments_by_tool(tools: Sequence[generation_pb2.Tool]) -> dict[str, ToolArguments]:
    return {tool.name: tool_arguments(tool) for tool in tools}


def _argument(name: str, required: bool, schema: dict, definitions: dict) -> Argument:
    if isinstance(schema, dict) and schema.get("maxLength", float("inf")) < schema.get("minLength", 0):
        raise UnsupportedArguments(f"the property {name!r} has a minLength above its maxLength")
    if _is_raw_string(schema):
        choices = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
        return Argument(name, required, True, schema, None if choices is None else tuple(choices),
                        int(schema.get("minLength", 0)), schema.get("maxLength"))
    return Argument(name, required, False, {**definitions, **schema})


def _is_raw_string(schema: object) -> bool:
    if not isinstance(schema, dict) or not set(schema) <= RAW_STRING_KEYS:
        return False
    choices = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if choices is not None:
        return isinstance(choices, list) and bool(choices) and all(isinstance(c, str) for c in choices) \
            and schema.get("type", "string") == "string"
    lengths = [schema.get(key, 0) for key in ("minLength", "maxLength")]
    return schema.get("type") == "string" and all(isinstance(n, int) and 0 <= n <= RAW_MAX_LENGTH for n in lengths)
