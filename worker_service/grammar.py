"""Rank 0's constraint masks: a matcher per constrained request, one batched bitmask per step.

Each constrained request's state holds a `RequestMatcher`. Before sampling, every constrained row
of the step brings its matcher up to the request's output so far (`sync`: a resumed request, or
one whose output arrived as a cached prefix, replays it into a fresh matcher), then one call
fills the bitmasks of all those rows, and the tokens a row's constraint forbids get -inf logits.
After sampling each matcher consumes the chosen token (`advance`). Unconstrained rows are never
touched: a step without constrained rows does no work here at all.

A speculative entry brings one row per verified position, all with the request's matcher: they
are filled in order, the matcher consuming each draft before the next row's mask, and only while
the draft is one the previous row's mask allows (a forbidden draft can never equal the draw, so
the rows after it are never used and get a copy of its mask). The executor then rolls the
matcher back to the accepted tokens (`sync`) and advances it over the sampled one.

EOS is in the mask exactly when the constraint is complete (the matcher knows the model's EOS
ids). A matcher that errs (the library's per-step limits, or a token it cannot take) allows only
EOS from then on, and the executor reports it (`RequestMatcher.error`, the task result's
`constraint_failures`), so that its request ends with an error, never as an output that
followed the constraint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import llguidance
import numpy as np
import torch

from radixserve.constraints import Constraint
from radixserve.grammar_compiler import GrammarCompiler
from radixserve.model_source import ModelUnreadable, load_tokenizer, resolve_model

log = logging.getLogger(__name__)


def fill_row(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, slot: int) -> None:
    """`matcher`'s allowed tokens as bits into row `slot` of the contiguous int32 CPU `bitmask`.
    (What `llguidance.torch` does, called directly: importing that module compiles a function
    with `torch.compile` at import, which loads TorchDynamo and Inductor into every worker
    process, seconds of start-up for a function we never call.)"""
    row = bitmask[slot]
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

BITS_PER_WORD = 32
# The bit pattern of float32 -inf: AND-ed with (allowed - 1), it gives 0.0 for an allowed token
# and -inf for a forbidden one, without branches (masked_fill branches per element and is
# several times slower on CPU).
_NEG_INF_BITS = torch.tensor(float("-inf"), dtype=torch.float32).view(torch.int32)


class RequestMatcher:
    """One request's matcher and how many of its output tokens it has consumed."""

    def __init__(self, request_id: str, matcher: llguidance.LLMatcher) -> None:
        self.request_id = request_id
        self.matcher = matcher
        self.num_consumed = 0

    def sync(self, output_ids: list[int]) -> None:
        """Consume the output tokens not yet consumed (the whole output for a fresh matcher)."""
        if len(output_ids) < self.num_consumed:  # never in the protocol; stay consistent anyway
            self.matcher.rollback(self.num_consumed - len(output_ids))
            self.num_consumed = len(output_ids)
        pending = output_ids[self.num_consumed:]
        if pending:
            self._consume(pending)

    def advance(self, token_id: int) -> None:
        """Consume the token just sampled."""
        self._consume([token_id])

    def error(self) -> str | None:
        """Why the matcher erred (the output no longer follows the constraint); None while it
        has not."""
        return self.matcher.get_error().strip() or "the constraint failed" if self.matcher.is_error() else None

    def _consume(self, token_ids: list[int]) -> None:
        # A stopped matcher (complete, or erred) takes nothing more, not even the EOS that
        # ends its request; it keeps allowing only EOS.
        if not self.matcher.is_stopped() and not self.matcher.consume_tokens(token_ids):
            log.warning("request %s: its constraint stopped: %s", self.request_id, self.matcher.get_error().strip())
        self.num_consumed += len(token_ids)


class ConstraintMasks:
    """Rank 0's grammar work: builds matchers and masks the logits of constrained rows."""

    def __init__(self, compiler: GrammarCompiler, vocab_size: int, eos_token_ids: list[int], num_threads: int) -> None:
        """`vocab_size` is the logits width. `num_threads` 1 fills the rows one after the other
        on the calling thread (no hand-off to a pool: the cheapest on a small CPU that the
        forward pass keeps busy); more fill them in parallel on llguidance's pool."""
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._num_words = (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD
        self._executor = llguidance.LLExecutor(num_threads) if num_threads > 1 else None
        eos = np.zeros(self._num_words * BITS_PER_WORD, dtype=np.uint8)
        eos[self.eos_token_ids] = 1
        self._eos_only = torch.from_numpy(np.packbits(eos, bitorder="little").view(np.int32))

    @classmethod
    def load(cls, model_dir: Path, vocab_size: int, eos_token_ids: list[int], cache_size: int,
             num_threads: int) -> ConstraintMasks | None:
        """From the model's tokenizer (its folder's or GGUF file's); None (constraints refused)
        when it has none."""
        try:
            hf_tokenizer = load_tokenizer(resolve_model(model_dir))
        except (OSError, ValueError) as exc:
            log.warning("no tokenizer in %s, so constrained requests are refused: %s", model_dir, exc)
            return None
        if len(hf_tokenizer) > vocab_size:  # its last tokens would have no row of logits or embeddings
            raise ModelUnreadable(f"the tokenizer has {len(hf_tokenizer)} tokens, more than the model's vocabulary "
                                  f"of {vocab_size}")
        compiler = GrammarCompiler.from_hf(hf_tokenizer, cache_size, vocab_size, eos_token_ids)
        return cls(compiler, vocab_size, eos_token_ids, num_threads)

    def new_matcher(self, request_id: str, constraint: Constraint) -> RequestMatcher:
        """Raises `InvalidConstraint` (the gateway checks first, so only a misconfigured stack)."""
        return RequestMatcher(request_id, self.compiler.matcher(constraint))

    def mask(self, logits: torch.Tensor, rows: list[tuple[int, RequestMatcher, list[int]]]) -> torch.Tensor:
        """Forbidden tokens of each (row index, matcher, output so far) get -inf; other rows are
        untouched. Each matcher is synced to its row's output before its mask is filled; the
        rows of one matcher are consecutive, each one token longer than the one before.

        Works in place on `logits` (the runner's fresh float32 output) and returns it.
        """
        bitmask = torch.zeros((len(rows), self._num_words), dtype=torch.int32)
        if len({id(matcher) for _, matcher, _ in rows}) < len(rows):
            self._fill_in_order(rows, bitmask)
        else:
            for _, matcher, output_ids in rows:
                matcher.sync(output_ids)
            if self._executor is None:
                for slot, (_, row, _) in enumerate(rows):
                    fill_row(row.matcher, bitmask, slot)
            else:
                # The rows' masks filled on the executor's threads, straight into the bitmask.
                self._executor.unsafe_compute_mask_ptr(
                    [(row.matcher, slot) for slot, (_, row, _) in enumerate(rows)],
                    bitmask.data_ptr(), self._num_words * 4, len(rows))
        self._allow_eos_where_empty(bitmask)
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(allowed[:, : self.vocab_size]).to(torch.int32)
        bias = allowed.sub_(1).bitwise_and_(_NEG_INF_BITS).view(torch.float32).to(logits.device)
        index = torch.tensor([row for row, _, _ in rows], device=logits.device)
        with torch.inference_mode():  # the runner's logits are inference tensors
            return logits.index_add_(0, index, bias)

    def _fill_in_order(self, rows: list[tuple[int, RequestMatcher, list[int]]], bitmask: torch.Tensor) -> None:
        """Fill row by row, walking each matcher over its rows' drafts (see the module docstring)."""
        eos = set(self.eos_token_ids)
        walking = False  # the previous row's matcher may go on to this row
        for slot, (_, matcher, output_ids) in enumerate(rows):
            continues = slot > 0 and rows[slot - 1][1] is matcher
            if continues and not (walking and self._may_consume(matcher, bitmask[slot - 1], output_ids[-1], eos)):
                bitmask[slot] = bitmask[slot - 1]  # never used: the draft before it is rejected
                walking = False
                continue
            matcher.sync(output_ids)
            fill_row(matcher.matcher, bitmask, slot)
            walking = True

    @staticmethod
    def _may_consume(matcher: RequestMatcher, allowed: torch.Tensor, token_id: int, eos: set[int]) -> bool:
        """Whether the walk may consume draft `token_id`: the previous row allows it, and it is
        neither the end (an accepted EOS ends the request) nor past a stopped matcher."""
        if token_id in eos or matcher.matcher.is_stopped():
            return False
        return (int(allowed[token_id // BITS_PER_WORD]) >> (token_id % BITS_PER_WORD)) & 1 == 1

    def _allow_eos_where_empty(self, bitmask: torch.Tensor) -> None:
        """A row with nothing allowed (its matcher erred) may only end: allow EOS."""
        empty = (bitmask == 0).all(dim=1)
        if bool(empty.any()):
            bitmask[empty] = self._eos_only
