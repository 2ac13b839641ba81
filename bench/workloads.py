"""The benchmark workloads, as chat conversations both engines run identically.

Every request is greedy with `ignore_eos`, so radixserve and transformers produce exactly
`max_tokens` tokens each and the token counts of both sides are the same.

A workload is a list of conversations. A conversation is a list of turns; turn t's messages are
the conversation so far (earlier turns' user messages and the assistant replies the engine gave)
plus the new user message, so a multi-turn conversation extends its own prefix every turn.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

WORDS = (
    "the model serves requests over a stream of tokens while the cache keeps pages of keys and "
    "values for every prefix it has seen so that later requests reuse them instead of computing "
    "again each step batches decodes with prefill chunks under a token budget and the router "
    "decides which pages hold which positions across ranks that share one group"
).split()


def synthetic_text(num_words: int, seed: int) -> str:
    """Deterministic filler text: different seeds give different text of the same shape."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words)).capitalize() + "."


@dataclass(frozen=True)
class Workload:
    """`conversations[c][t]` is the user message of turn t of conversation c."""

    name: str
    description: str
    system_prompt: str | None
    conversations: list[list[str]]
    max_tokens: int
    # How every engine samples the replies: 0 is greedy (the default); otherwise unseeded draws at
    # this temperature after top_p (`run_all --temperature / --top-p`).
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def num_requests(self) -> int:
        return sum(len(turns) for turns in self.conversations)


def shared_system_prompt(num_requests: int, max_tokens: int, prompt_words: int = 450,
                         variant: int = 0) -> Workload:
    """(a) Many requests behind one long system prompt: the prefix cache's best case.

    The system prompt is the same for every variant; the questions differ between variants, so
    runs of one benchmark never repeat each other's requests.
    """
    system = "You are a support assistant. Follow this policy. " + synthetic_text(prompt_words, 7)
    base = 100_000 * (variant + 1)
    questions = [[f"Question {i}: {synthetic_text(12, base + i)}"] for i in range(num_requests)]
    return Workload("shared_prefix", "long shared system prompt, short distinct questions",
                    system, questions, max_tokens)


def distinct_prompts(num_requests: int, max_tokens: int, prompt_words: int = 150,
                     variant: int = 0) -> Workload:
    """(b) Distinct prompts: nothing to reuse but the chat template's few leading tokens.

    Each variant draws other prompts, so runs of one benchmark never hit each other's cache.
    """
    base = 100_000 * (variant + 1) + 50_000
    prompts = [[synthetic_text(prompt_words, base + i)] for i in range(num_requests)]
    return Workload("distinct", "distinct prompts, no shared prefix", None, prompts, max_tokens)


def single_stream(max_tokens: int, variant: int = 0) -> Workload:
    """(c) One long stream: decode latency of a single sequence."""
    subject = "a lighthouse keeper" if variant == 0 else f"lighthouse keeper number {variant}"
    return Workload("single_stream", "one request, long output", None,
                    [[f"Write a long story about {subject}."]], max_tokens)


def multi_turn(num_conversations: int, num_turns: int, max_tokens: int, variant: int = 0) -> Workload:
    """(d) Multi-turn chat: each turn resends the conversation so far plus a new message."""
    base = 3000 + 100_000 * variant
    conversations = [
        [f"Turn {t}: {synthetic_text(25, base + 100 * c + t)}" for t in range(num_turns)]
        for c in range(num_conversations)
    ]
    return Workload("multi_turn", f"{num_turns}-turn chats, each turn extends the last",
                    "You are a helpful assistant.", conversations, max_tokens)


CODE_NAMES = ("total", "count", "items", "limit", "result", "value", "index", "queue")


def code_file(seed: int, num_functions: int = 8) -> str:
    """A small Python module of ~400 tokens; different seeds give different names and numbers."""
    rng = random.Random(seed)
    functions = []
    for index in range(num_functions):
        a, b = rng.sample(CODE_NAMES, 2)
        functions.append(
            f"def step_{index}({a}, {b}):\n"
            f"    \"\"\"Combine {a} with {b} for stage {index}.\"\"\"\n"
            f"    if {a} > {rng.randrange(2, 99)}:\n"
            f"        return {a} - {b} * {rng.randrange(2, 9)}\n"
            f"    return {a} + {b}\n"
        )
    return "\n\n".join(functions)


def quote_edit(max_tokens: int, variant: int = 0) -> Workload:
    """(e) Quote and edit: a ~400-token code file asked back with one small change, the case
    where output repeats the prompt (speculation's best case)."""
    source = code_file(7_000 + variant)
    ask = ("Here is a Python file:\n\n" + source + "\n\nRewrite the whole file exactly as it is, "
           "but rename the function step_3 to stage_three. Reply with the code only.")
    return Workload("quote_edit", "a 400-token code file asked back with one rename", None, [[ask]], max_tokens)


def build_messages(system_prompt: str | None, history: list[tuple[str, str]], user: str
                   ) -> list[dict[str, str]]:
    """Chat messages for a turn: system, earlier (user, assistant) pairs, the new user message."""
    messages: list[dict[str, str]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    for asked, answered in history:
        messages.append({"role": "user", "content": asked})
        messages.append({"role": "assistant", "content": answered})
    messages.append({"role": "user", "content": user})
    return messages


def lockstep_turns(workload: Workload, concurrency: int, time_limit_s: float
                   ) -> Iterator[tuple[int, list[int], dict[int, list[tuple[str, str]]]]]:
    """How an offline peer runs a workload: conversations `concurrency` at a time, each group's
    turns in lockstep. Yields (turn, the group's conversations that have this turn, the group's
    histories); the caller appends each (user message, reply) to `histories[c]` before the next
    turn. No new group starts after `time_limit_s`."""
    started = time.monotonic()
    for group_start in range(0, len(workload.conversations), concurrency):
        if time.monotonic() - started > time_limit_s:
            return
        group = list(range(group_start, min(group_start + concurrency, len(workload.conversations))))
        histories: dict[int, list[tuple[str, str]]] = {c: [] for c in group}
        for turn in range(max(len(workload.conversations[c]) for c in group)):
            yield turn, [c for c in group if turn < len(workload.conversations[c])], histories
