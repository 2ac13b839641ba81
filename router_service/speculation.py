"""Speculative decoding's policy on the router: when to draft, how many, and what it earned.

Drafts come from `ngram_proposer` (the request's own prompt and output). Whether a decoding
request gets them this step is decided at two levels:
- per step: a step that decodes many requests at once is compute-bound, so verifying drafts
  there costs nearly as much as the tokens they could save. With more than
  `max_running` decoding requests no drafts are proposed; below that, each gets at most `k`.
- per request: each verified step updates the request's acceptance (an exponential moving
  average of accepted / drafted, starting at `min_acceptance`), and a request drafts
  `k * acceptance` tokens (at least one): a new request probes with a few, one whose drafts keep
  being right works up to `k`. While the acceptance is under `min_acceptance` the request drafts
  nothing for a cool-down of steps that doubles each time it fails again (up to
  `max_backoff_steps`) and resets once drafts pay again, so text that does not repeat its
  context costs a short probe now and then, not a wasted verification every step.
The acceptance rule itself lives on rank 0 (`worker_service.draft_verify`): exact for greedy and
seeded sampling, so none of this can change a request's output, only its speed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from radixserve.flags import add_flag
from router_service.ngram_proposer import EncodedSequence, propose

# Weight of the newest step in a request's acceptance average: about the last five steps count.
ACCEPTANCE_SMOOTHING = 0.3


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """The router's speculative decoding settings (see the module docstring)."""

    enabled: bool = True
    # Most draft tokens per request per step.
    k: int = 8
    # Suffix lengths tried, longest first.
    min_ngram: int = 2
    max_ngram: int = 8
    # Most decoding requests in a step for drafts to be proposed at all.
    max_running: int = 4
    # A request whose recent acceptance is below this backs off.
    min_acceptance: float = 0.3
    max_backoff_steps: int = 64

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError("speculative k must be >= 1")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("speculative n-gram range must satisfy 1 <= min <= max")
        if self.max_running < 1:
            raise ValueError("speculative max_running must be >= 1")
        if not 0 <= self.min_acceptance <= 1:
            raise ValueError("speculative min_acceptance must be in [0, 1]")
        if self.max_backoff_steps < 1:
            raise ValueError("speculative max_backoff_steps must be >= 1")


def add_speculation_flags(parser: argparse.ArgumentParser) -> None:
    defaults = SpeculationConfig()
    add_flag(parser, "speculative", type=bool, default=defaults.enabled,
             help="speculative decoding: draft tokens by n-gram lookup in each request's own "
             "prompt and output, verified in one forward pass (outputs are unchanged)")
    add_flag(parser, "speculative-k", type=int, default=defaults.k,
             help="most draft tokens per request per step")
    add_flag(parser, "speculative-min-ngram", type=int, default=defaults.min_ngram,
             help="shortest suffix looked up for drafts")
    add_flag(parser, "speculative-max-ngram", type=int, default=defaults.max_ngram,
             help="longest suffix looked up for drafts (tried first)")
    add_flag(parser, "speculative-max-running", type=int, default=defaults.max_running,
             help="no drafts in a step that decodes more requests than this (compute bound)")
    add_flag(parser, "speculative-min-acceptance", type=float, default=defaults.min_acceptance,
             help="a request whose recent draft acceptance falls below this stops drafting "
             "for a while (the pause doubles while it stays low)")
    add_flag(parser, "speculative-max-backoff-steps", type=int, default=defaults.max_backoff_steps,
             help="longest pause, in steps, of a request whose drafts are rejected")


def speculation_from_args(args: argparse.Namespace) -> SpeculationConfig:
    return SpeculationConfig(
        enabled=args.speculative,
        k=args.speculative_k,
        min_ngram=args.speculative_min_ngram,
        max_ngram=args.speculative_max_ngram,
        max_running=args.speculative_max_running,
        min_acceptance=args.speculative_min_acceptance,
        max_backoff_steps=args.speculative_max_backoff_steps,
    )


class DraftState:
    """One request's speculation: its encoded sequence, acceptance and counters."""

    __slots__ = ("sequence", "acceptance", "cooldown", "backoff", "num_drafted", "num_accepted")

    def __init__(self) -> None:
        self.sequence = EncodedSequence()
        self.acceptance = -1.0  # no verified step yet (see `Speculator.drafts`)
        self.cooldown = 0  # steps left without drafts
        self.backoff = 1  # the next cool-down's length
        self.num_drafted = 0
        self.num_accepted = 0

    def record(self, num_drafted: int, num_accepted: int, config: SpeculationConfig) -> None:
        """A verified step: update the acceptance and, when it is low, start a cool-down."""
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        rate = num_accepted / num_drafted
        self.acceptance += ACCEPTANCE_SMOOTHING * (rate - self.acceptance)
        if self.acceptance >= config.min_acceptance:
            self.backoff = 1
            return
        self.cooldown = self.backoff
        self.backoff = min(2 * self.backoff, config.max_backoff_steps)
        # After the pause the request is tried afresh, at the threshold: one good step keeps it.
        self.acceptance = config.min_acceptance


class Speculator:
    """Proposes drafts for a step's decoding requests, within the step's budget and pages."""

    def __init__(self, config: SpeculationConfig, context_len: int) -> None:
        self.config = config
        self.context_len = context_len

    def wants_drafts(self, num_decoding: int) -> bool:
        """Whether a step decoding `num_decoding` requests proposes drafts at all."""
        return self.config.enabled and 0 < num_decoding <= self.config.max_running

    def drafts(self, state: DraftState, token_ids: list[int], num_remaining: int, limit: int) -> list[int]:
        """Drafts to verify after the pending token of a request with `token_ids`.

        `num_remaining` is the output it may still produce (max_tokens or the context), counting
        the pending token's successor: drafts past that could never be kept. `limit` caps
        them further (the step's token budget).
        """
        if state.cooldown > 0:
            state.cooldown -= 1
            return []
        if state.acceptance < 0:
            state.acceptance = self.config.min_acceptance  # a new request starts with a probe
        wanted = max(1, round(self.config.k * state.acceptance))
        # The step yields the accepted drafts plus one sampled token, so at most
        # num_remaining - 1 drafts can be used; the last position must fit the context.
        room = min(wanted, num_remaining - 1, limit, self.context_len - len(token_ids))
        return propose(state.sequence, token_ids, room, self.config.min_ngram, self.config.max_ngram)
