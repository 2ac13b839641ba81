"""Constraints compiled into llguidance matchers for one tokenizer, each distinct constraint once.

llguidance was chosen over xgrammar on measurements with the SmolLM2 tokenizer (see the commit
that added it): a typical JSON schema compiles in ~1.5 ms against ~0.6-1.3 s, many pathological
regexes stop on the library's own fuel limits (not all: some constructions run for seconds
whatever the fuel), and it needs no other package. Its per-step mask costs more (~0.04 ms a row against ~0.01 ms), which is small
next to a forward pass.

The gateway compiles to validate (in a separate process it can stop, under a timeout); rank 0
compiles to get the matchers it samples with. Both use the same library, tokenizer and limits,
so what the gateway accepted compiles on rank 0 too. A compiled constraint is a template matcher in its start state;
each request gets a `deep_copy` of it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf

from radixserve.constraints import Constraint, ConstraintKind

# Compact JSON with the separators of Python's json.dumps: a fixed layout cannot run away into
# endless whitespace, which flexible whitespace lets a sampled model do.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# OpenAI's json_object: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Error messages without the parser's state dump (which may quote the schema at length).
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
SILENT = 0  # llguidance log level: errors come back as values, not as stderr warnings
# The names `after_reasoning` gives its grammar and, where it has none, the constraint's.
REASONING_FIRST, ANSWER = "radixserve_reasoning", "radixserve_answer"


class InvalidConstraint(ValueError):
    """The grammar library rejected the constraint; the message is the library's."""


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar for a constraint; raises `InvalidConstraint` for what cannot be one."""
    kind = constraint.kind
    try:
        if kind is ConstraintKind.JSON_SCHEMA:
            return llguidance.LLMatcher.grammar_from_json_schema(constraint.text, overrides=JSON_OPTIONS)
        if kind is ConstraintKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA, overrides=JSON_OPTIONS)
        if kind is ConstraintKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(constraint.text)
        if kind is ConstraintKind.GRAMMAR:
            return llguidance.grammar_from("grammar", constraint.text)  # Lark, or GBNF converted
        if kind is ConstraintKind.LLGUIDANCE:
            return constraint.text
        return llguidance.grammar_from("choice", json.dumps(list(constraint.choices)))
    except ValueError as exc:
        raise InvalidConstraint(f"constraint.{kind.value}: {exc}") from exc


def after_reasoning(constraint: Constraint, reasoning: str, rules: str) -> Constraint:
    """`constraint` behind a reasoning part: the output is `reasoning` (a Lark expression over
    `rules`, which define it) and then what `constraint` allows, as llguidance's own grammar JSON
    (the constraint's grammars follow, the first referred to by name). Raises `InvalidConstraint`
    where the constraint itself is not a grammar."""
    grammar = grammar_of(constraint)
    if grammar.lstrip().startswith("{"):
        inner = json.loads(grammar)["grammars"]
    else:
        inner = [{"lark_grammar": grammar}]
    first = inner[0].get("name") or ANSWER
    inner = [{**inner[0], "name": first}, *inner[1:]]
    outer = {"name": REASONING_FIRST, "lark_grammar": f"start: {reasoning} @{first}\n{rules}"}
    return Constraint(ConstraintKind.LLGUIDANCE, text=json.dumps({"grammars": [outer, *inner]}))


def build_matcher(tokenizer: llguidance.LLTokenizer, constraint: Constraint) -> llguidance.LLMatcher:
    """A template matcher for `constraint`; raises `InvalidConstraint` with the library's message.

    Construction drops the GIL; the first mask is computed here as well, because the lexer is
    built lazily and some errors (too many states for a regex) only show up then. The library's
    limits do not bound every construction in time, so a caller that must answer in bounded time
    runs this where it can be stopped (the gateway: `gateway_service.compile_processes`).
    """
    problems = constraint.problems()
    if problems:
        raise InvalidConstraint("; ".join(problems))
    grammar = grammar_of(constraint)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=SILENT, limits=LIMITS)
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        raise InvalidConstraint(f"constraint.{constraint.kind.value}: {matcher.get_error().strip()}")
    return matcher


def tokenizer_from_hf(hf_tokenizer, vocab_size: int | None = None,
                      eos_token_ids: list[int] | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer. `vocab_size` is the model's logits
    width (it may exceed the tokenizer's); `eos_token_ids` the ids that end the output when the
    constraint is complete (default: the tokenizer's EOS). Takes about a second: build once."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids or None)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and keeps the last `cache_size` distinct ones.

    The library's rejections are cached too (they depend on the text alone), so a constraint
    that is slow to fail costs that time once. Thread-safe: rank 0 compiles on a pool of threads.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, cache_size: int) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher | InvalidConstraint] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_hf(
        cls, hf_tokenizer, cache_size: int, vocab_size: int | None = None, eos_token_ids: list[int] | None = None
    ) -> GrammarCompiler:
        """For a Hugging Face fast tokenizer (see `tokenizer_from_hf`)."""
        return cls(tokenizer_from_hf(hf_tokenizer, vocab_size, eos_token_ids), cache_size)

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        """The template matcher of `constraint` (do not advance it: `matcher` copies it).

        Raises `InvalidConstraint` with the library's message.
        """
        with self._lock:
            cached = self._cache.get(constraint)
            if cached is not None:
                self._cache.move_to_end(constraint)
        if cached is None:
            try:
                cached = build_matcher(self.tokenizer, constraint)
            except InvalidConstraint as exc:
                cached = exc
            self._store(constraint, cached)
        if isinstance(cached, InvalidConstraint):
            raise cached
        return cached

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher for one request, in the constraint's start state."""
        return self.compile(constraint).deep_copy()

    def _store(self, constraint: Constraint, compiled: llguidance.LLMatcher | InvalidConstraint) -> None:
        with self._lock:
            self._cache[constraint] = compiled
            self._cache.move_to_end(constraint)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
