"""A constraint behind a thinking model's reasoning: the model thinks freely, then the constraint
binds its answer.

Where the output is split at `<think>` (`reasoning`), a structured-output constraint
(`response_format`, `guided_*`, the tools' grammar) would otherwise bind the output from its first
token, so the model could not think first. Instead the output may start with one reasoning block
(blank lines, `<think>`, any text without `</think>`, `</think>`, up to two line breaks), or, where
the prompt already opened the block, starts inside it, and the constraint binds what follows
(`grammar_compiler.after_reasoning`). So a model that does not think goes straight to the
constrained answer, and one that thinks is constrained from `</think>` on. The tags are written as
their tokens where they are special tokens (`lark_writer.Lark`). gpt-oss's harmony format has its
own rule: the constraint binds the final message (`harmony_grammar`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gateway_service.chat_format import ChatFormat, ChatPlan
from gateway_service.chat_output import prompt_opens_block
from gateway_service.constraint_check import ConstraintChecker
from gateway_service.errors import InvalidRequest
from gateway_service.harmony_grammar import harmony_answer
from gateway_service.lark_writer import Lark
from gateway_service.reasoning import CLOSE, HARMONY, OPEN, THINK
from gateway_service.tokenizer import Tokenizer
from radixserve import constraints
from radixserve.constraints import Constraint
from radixserve.grammar_compiler import after_reasoning
from radixserve.v1 import generation_pb2


async def checked_constraint(request: generation_pb2.GenerateRequest, plan: ChatPlan, chat: ChatFormat,
                             require_checker: Callable[[], ConstraintChecker], prompt_ids: list[int],
                             tokenizer: Tokenizer, client: str) -> Constraint | None:
    """The request's constraint (the tools' grammar, or its own), compiled once to check it;
    behind the reasoning block where the output is split at <think>. The checker is asked for
    only where there is a constraint."""
    constraint = plan.constraint or constraints.from_proto(request.constraint)
    if constraint is None:
        return None
    checker = require_checker()
    try:
        await checker.check(constraint, client)
    except InvalidRequest as exc:
        if plan.constraint is None:
            raise
        # The tools' grammar failed: a parameters schema the grammar library refused.
        raise InvalidRequest(f"tools: {exc.message}") from None
    if plan.split_reasoning and chat.reasoning == THINK:
        constraint = reasoning_then(constraint, dict(chat.special_tags), prompt_opens_block(prompt_ids, tokenizer))
        await checker.check(constraint, client)
    elif plan.split_reasoning and chat.reasoning == HARMONY and plan.constraint is None:
        # gpt-oss: the final message's body (a required call's grammar is harmony already)
        constraint = harmony_answer(constraint, dict(chat.special_tags))
        await checker.check(constraint, client)
    return constraint


def reasoning_then(constraint: Constraint, special: Mapping[str, int], inside: bool) -> Constraint:
    """`constraint` after the reasoning block; `inside`: the prompt opened the block already."""
    lark = Lark(special)
    thoughts = lark.text_then([CLOSE], [CLOSE])
    ending = lark.rule(r"/\n{1,2}/")
    if inside:
        return after_reasoning(constraint, f"{thoughts} {ending}?", lark.text())
    blank = lark.rule(r"/\n+/")
    block = lark.rule(f"{blank}? {lark.tag(OPEN)} {thoughts} {ending}?")
    return after_reasoning(constraint, f"{block}?", lark.text())
