"""Lark grammars for llguidance, written piece by piece: numbered rules and lexemes, literals, and
tags written as their special tokens (`<[id]>`) where the tokenizer has them as such, else as
their text. Used by the tool grammars (`tool_grammar`, `tool_grammar_layouts`, `harmony_grammar`)
and the reasoning block in front of a constraint (`reasoning_constraint`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from radixserve.grammar_compiler import JSON_OPTIONS


def regex_escape(text: str) -> str:
    """`text` as a literal inside a Lark `/regex/` (llguidance's syntax: `\\<` would be a word start)."""
    return "".join(_ESCAPES.get(char, "\\" + char if char in _REGEX_SPECIAL else char) for char in text)


_REGEX_SPECIAL = frozenset("\\.^$|?*+()[]{}/")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def literal(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class Lark:
    """A grammar being written: numbered rules and lexemes, and the tags' spelling."""

    def __init__(self, special: Mapping[str, int]) -> None:
        self.special = special
        self.lines: list[str] = []

    def tag(self, text: str) -> str:
        return f"<[{self.special[text]}]>" if text in self.special else literal(text)

    def rule(self, body: str) -> str:
        name = f"r{len(self.lines)}"
        self.lines.append(f"{name}: {body}")
        return name

    def json_value(self, schema: dict) -> str:
        return self.rule(f"%json {json.dumps({'x-guidance': JSON_OPTIONS, **schema})}")

    def text_then(self, close: Sequence[str], excluded: Sequence[str], low: int = 0, high: int | None = None,
                  pattern: str | None = None) -> str:
        """Text of `low` to `high` characters (or matching `pattern`) that holds none of `excluded`,
        then `close` (tags and text): the text part of `close` before its first special token is in
        the text's lexeme."""
        first_special = next((i for i, piece in enumerate(close) if piece in self.special), len(close))
        spelled = "".join(close[:first_special])
        rest = " ".join(self.tag(piece) for piece in close[first_special:])
        optional = not spelled and pattern is None and low == 0
        if high == 0 and optional:  # only the empty text
            return rest
        if pattern is None:  # an empty text is no lexeme: one ended by a special token is optional instead
            low = max(low, 1) if optional else low
            pattern = ".*" if (low, high) == (0, None) else f".{{{low},{'' if high is None else high}}}"
        name = f"T{len(self.lines)}"
        lexeme = f"/(?s:{pattern}){regex_escape(spelled)}/"
        if excluded:  # a closing tag may only end it (where it is spelled in the lexeme)
            tags = "|".join(regex_escape(tag) for tag in excluded)
            lexeme += f" & ~/(?s:.*)({tags})(?s:{'.+' if spelled else '.*'})/"
        self.lines.append(f"{name}: {lexeme}")
        return f"{name}{'?' if optional else ''} {rest}".strip()

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"
