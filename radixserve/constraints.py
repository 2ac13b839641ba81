"""A request's output constraint (structured output): what the gateway checks, the router carries
and rank 0 enforces.

One value for every kind: a JSON schema, a regular expression, a grammar, a list of choices,
"any JSON object", or llguidance's own grammar JSON (what the gateway makes of a constraint that
follows a reasoning block, `grammar_compiler.after_reasoning`). It is hashable, so the grammar compiler caches by it (same text, same
compiled grammar). On the wire it is `radixserve.v1.Constraint`; `to_proto` / `from_proto` are
the only mapping. This module stays free of the grammar library, so the router can import it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from radixserve.v1 import generation_pb2

# Every input is bounded at the edge (a JSON schema of tool definitions is rarely over a few KB).
MAX_CONSTRAINT_CHARS = 256 * 1024
MAX_CHOICES = 1024


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    GRAMMAR = "grammar"
    CHOICE = "choice"
    JSON_OBJECT = "json_object"
    LLGUIDANCE = "llguidance"


@dataclass(slots=True, frozen=True)
class Constraint:
    """`text` holds the schema, regex or grammar; `choices` the strings of a CHOICE; a
    JSON_OBJECT has neither."""

    kind: ConstraintKind
    text: str = ""
    choices: tuple[str, ...] = ()

    def describe(self) -> str:
        """A short form for logs and error messages (never the whole schema)."""
        if self.kind is ConstraintKind.CHOICE:
            return f"choice of {len(self.choices)}"
        if self.kind is ConstraintKind.JSON_OBJECT:
            return "json_object"
        return f"{self.kind.value} of {len(self.text)} chars"

    def problems(self) -> list[str]:
        """What is wrong with the constraint's shape (empty when the grammar library may try it).

        Whether the schema, regex or grammar itself is valid only the library can say.
        """
        name = f"constraint.{self.kind.value}"
        found = []
        if self.kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.REGEX, ConstraintKind.GRAMMAR,
                         ConstraintKind.LLGUIDANCE):
            if not self.text:
                found.append(f"{name} is empty")
            elif len(self.text) > MAX_CONSTRAINT_CHARS:
                found.append(f"{name} is longer than {MAX_CONSTRAINT_CHARS} characters")
        if self.kind is ConstraintKind.JSON_SCHEMA and self.text:
            try:
                schema = json.loads(self.text)
            except ValueError as exc:
                found.append(f"{name} is not valid JSON: {exc}")
            else:
                if not isinstance(schema, (dict, bool)):
                    found.append(f"{name} must be a JSON object, got {type(schema).__name__}")
        if self.kind is ConstraintKind.LLGUIDANCE and self.text:
            try:
                grammars = json.loads(self.text).get("grammars")
            except (ValueError, AttributeError):
                grammars = None
            if not isinstance(grammars, list) or not grammars:
                found.append(f'{name} must be a JSON object with a non-empty list "grammars"')
        if self.kind is ConstraintKind.CHOICE:
            if not self.choices:
                found.append(f"{name} needs at least one choice")
            elif len(self.choices) > MAX_CHOICES:
                found.append(f"{name} has {len(self.choices)} choices, at most {MAX_CHOICES}")
            elif any(not choice for choice in self.choices):
                found.append(f"{name} has an empty choice")
            elif sum(map(len, self.choices)) > MAX_CONSTRAINT_CHARS:
                found.append(f"{name} is longer than {MAX_CONSTRAINT_CHARS} characters in all")
        return found


def from_proto(message: generation_pb2.Constraint) -> Constraint | None:
    """None when no kind is set (or `json_object: false`)."""
    which = message.WhichOneof("kind")
    if which is None or (which == "json_object" and not message.json_object):
        return None
    kind = ConstraintKind(which)
    if kind is ConstraintKind.CHOICE:
        return Constraint(kind, choices=tuple(message.choice.choices))
    if kind is ConstraintKind.JSON_OBJECT:
        return Constraint(kind)
    return Constraint(kind, text=getattr(message, which))


def to_proto(constraint: Constraint | None) -> generation_pb2.Constraint | None:
    """None for no constraint, so callers can pass it straight to a message field."""
    if constraint is None:
        return None
    if constraint.kind is ConstraintKind.CHOICE:
        return generation_pb2.Constraint(choice=generation_pb2.Choices(choices=constraint.choices))
    if constraint.kind is ConstraintKind.JSON_OBJECT:
        return generation_pb2.Constraint(json_object=True)
    return generation_pb2.Constraint(**{constraint.kind.value: constraint.text})
