"""Constraints in harmony, gpt-oss's output format (`harmony`): the model thinks in its analysis
channel, then answers in the final channel or calls a function from the commentary channel, so
a constraint binds that answer or that call, never the markup around it.

- A structured-output constraint (`response_format`, `guided_*`) binds the final message's body:
  the output is any number of analysis messages (free text), then
  `<|channel|>final<|message|>` and what the constraint allows (`harmony_answer`);
- a required tool call (`tool_choice: "required"` or a named function) is, after the analysis
  messages, one call as gpt-oss writes it:
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`, its arguments the
  tool's parameters schema (`harmony_call_grammar`). gpt-oss ends its turn at a call, so a turn
  holds one call whatever `parallel_tool_calls` says.

The end of the output (`<|return|>` after the answer, `<|call|>` after a call: the model's ends
of sequence) comes once the constraint is complete. Markers are written as their tokens where
they are special tokens, as in every released gpt-oss tokenizer (`lark_writer.Lark`).
`tool_choice: "auto"` is not constrained: calls are parsed from whatever the model writes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from gateway_service.harmony import ANALYSIS, CHANNEL, CONSTRAIN, END, FUNCTIONS, MARKERS, MESSAGE, START
from gateway_service.lark_writer import Lark, literal
from radixserve.constraints import Constraint
from radixserve.grammar_compiler import after_reasoning
from radixserve.v1 import generation_pb2

FINAL = "final"


def _thinking(lark: Lark) -> str:
    """Any number of analysis messages, each closed and followed by the next message's start."""
    text = lark.text_then([END], MARKERS)
    message = lark.rule(f"{lark.tag(CHANNEL)} {literal(ANALYSIS)} {lark.tag(MESSAGE)} {text} "
                        f"{lark.tag(START)} {literal('assistant')}")
    return f"{message}*"


def harmony_answer(constraint: Constraint, special: Mapping[str, int]) -> Constraint:
    """`constraint` as the body of the final message, after the analysis."""
    lark = Lark(special)
    thinking = _thinking(lark)
    final = lark.rule(f"{lark.tag(CHANNEL)} {literal(FINAL)} {lark.tag(MESSAGE)}")
    return after_reasoning(constraint, f"{thinking} {final}", lark.text())


def harmony_call_grammar(tools: Sequence[generation_pb2.Tool], special: Mapping[str, int]) -> str:
    """The Lark grammar of one call of one of `tools` (already narrowed to the named one, if
    any), after the analysis."""
    lark = Lark(special)
    thinking = _thinking(lark)
    calls = []
    for tool in tools:
        arguments = lark.json_value(json.loads(tool.parameters) if tool.parameters else {"type": "object"})
        calls.append(lark.rule(
            f"{lark.tag(CHANNEL)} {literal(f'commentary to={FUNCTIONS}{tool.name} ')} {lark.tag(CONSTRAIN)} "
            f"{literal('json')} {lark.tag(MESSAGE)} {arguments}"))
    return f"start: {thinking} ({' | '.join(calls)})\n" + lark.text()
