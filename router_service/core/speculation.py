"""Speculative decoding's policy on the router: when to draft, how many, and what it earned.

Drafts come from `ngram_proposer` (the request's own prompt and output). Whether a decoding
request gets them this step is decided at two levels:
- per step: a step that decodes many requests at once is compute-bound, so verifying drafts
  there costs nearly as much as the tokens they could save. With more than
  `speculative_max_running` decoding requests no drafts are proposed; below that, each gets at
  most `speculative_k`.
- per request: each verified step updates the request's acceptance (an exponential moving
  average of accepted / drafted, starting at the back-off threshold), and a request drafts
  `speculative_k * acceptance` tokens (at least one): a new request probes with a few, one whose
  drafts keep being right works up to `speculative_k`. While the acceptance is under
  `speculative_min_acceptance` the request drafts nothing for a cool-down of steps that doubles
  each time it fails again (up to `speculative_max_backoff_steps`) and resets once drafts pay
  again, so text that does not repeat its context costs a short probe now and then, not a wasted
  verification every step.
- what drafts cost: the threshold is at least `speculative_min_acceptance`, and higher where this
  router's own steps show drafts cost more (`VerifyCost`): a step of one token takes `decode_s`,
  each draft verified beside it adds `per_draft_s`, and a step yields 1 + acceptance x drafts
  tokens, so drafting beats plain decoding only while the acceptance exceeds per_draft_s /
  decode_s. Where a step reads its weights once for all its tokens (a GPU, an unquantized model on
  a CPU) a draft costs a few percent of a step; with quantized weights on a CPU, whose products
  compute each row in full, about half (SmolLM2's Q4_1 file: 1 + 8 tokens took 43 ms on the
  worker's compiled layer against 8 for one), and a fixed 0.3 drafted at a loss.
The acceptance rule itself lives on rank 0 (`worker_service.draft_verify`): exact for greedy and
seeded sampling, so none of this can change a request's output, only its speed.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve import flags
from radixserve.flags import setting
from router_service.core.ngram_proposer import EncodedSequence, propose

# Weight of the newest step in a request's acceptance average: about the last five steps count.
ACCEPTANCE_SMOOTHING = 0.3
# Weight of the newest step in the measured step costs (`VerifyCost`): about the last ten count.
COST_SMOOTHING = 0.1


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    """The router's speculative decoding settings (see the module docstring)."""

    speculative: bool = setting(True, "speculative decoding: draft tokens by n-gram lookup in each request's "
                                "own prompt and output, verified in one forward pass (outputs are unchanged)")
    speculative_k: int = setting(8, "most draft tokens per request per step", min=1)
    speculative_min_ngram: int = setting(2, "shortest suffix looked up for drafts", min=1)
    speculative_max_ngram: int = setting(8, "longest suffix looked up for drafts (tried first)", min=1)
    speculative_max_running: int = setting(1, "no drafts in a step that decodes more requests than this "
                                           "(compute bound)", min=1)
    speculative_min_acceptance: float = setting(0.3, "a request whose recent draft acceptance falls below this "
                                                "stops drafting for a while (the pause doubles while it "
                                                "stays low)", min=0, max=1)
    speculative_max_backoff_steps: int = setting(64, "longest pause, in steps, of a request whose drafts are "
                                                 "rejected", min=1)

    def __post_init__(self) -> None:
        flags.check(self)
        if self.speculative_min_ngram > self.speculative_max_ngram:
            raise ValueError("--speculative-min-ngram must not exceed --speculative-max-ngram")


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

    def record(self, num_drafted: int, num_accepted: int, threshold: float, max_backoff_steps: int) -> None:
        """A verified step: update the acceptance and, when it is under `threshold` (the
        speculator's `min_acceptance()`), start a cool-down."""
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        rate = num_accepted / num_drafted
        self.acceptance += ACCEPTANCE_SMOOTHING * (rate - self.acceptance)
        if self.acceptance >= threshold:
            self.backoff = 1
            return
        self.cooldown = self.backoff
        self.backoff = min(2 * self.backoff, max_backoff_steps)
        # After the pause the request is tried afresh, at the threshold: one good step keeps it.
        self.acceptance = threshold


class VerifyCost:
    """What a draft costs on this router's steps (module doc), from the wall time of each step
    whose only entry decodes one request: `decode_s`, of those without drafts, and `per_draft_s`,
    each verified draft's share of the rest in those with drafts; exponentially weighted means
    (`COST_SMOOTHING`), zero until measured. Steps of more entries, prefills and speculative
    decoding's own first steps (no plain step measured yet) teach it nothing."""

    __slots__ = ("decode_s", "per_draft_s")

    def __init__(self) -> None:
        self.decode_s = 0.0
        self.per_draft_s = 0.0

    def observe(self, drafts: int, seconds: float) -> None:
        """A step whose only entry decoded one request's pending token and `drafts` drafts
        (`Scheduler.observe_step` picks them) took `seconds`."""
        if drafts == 0:
            self.decode_s = _smoothed(self.decode_s, seconds)
        elif self.decode_s > 0.0:
            self.per_draft_s = _smoothed(self.per_draft_s, max(0.0, seconds - self.decode_s) / drafts)

    def break_even(self) -> float:
        """The acceptance under which drafting loses time (0 until both costs are measured)."""
        if self.decode_s <= 0.0 or self.per_draft_s <= 0.0:
            return 0.0
        return self.per_draft_s / self.decode_s


def _smoothed(mean: float, sample: float) -> float:
    return sample if mean == 0.0 else mean + COST_SMOOTHING * (sample - mean)


class Speculator:
    """Proposes drafts for a step's decoding requests, within the step's budget and pages."""

    def __init__(self, config: SpeculationConfig, context_len: int) -> None:
        self.config = config
        self.context_len = context_len
        self.cost = VerifyCost()

    def min_acceptance(self) -> float:
        """The acceptance a request must keep to go on drafting: the configured floor, or what
        drafts are measured to cost where that is higher (module doc)."""
        return max(self.config.speculative_min_acceptance, self.cost.break_even())

    def record(self, state: DraftState, num_drafted: int, num_accepted: int) -> None:
        """A verified step of the request whose speculation is `state`."""
        state.record(num_drafted, num_accepted, self.min_acceptance(), self.config.speculative_max_backoff_steps)

    def wants_drafts(self, num_decoding: int) -> bool:
        """Whether a step decoding `num_decoding` requests proposes drafts at all."""
        return self.config.speculative and 0 < num_decoding <= self.config.speculative_max_running

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
            state.acceptance = self.min_acceptance()  # a new request starts with a probe
        wanted = max(1, round(self.config.speculative_k * state.acceptance))
        # The step yields the accepted drafts plus one sampled token, so at most
        # num_remaining - 1 drafts can be used; the last position must fit the context.
        room = min(wanted, num_remaining - 1, limit, self.context_len - len(token_ids))
        return propose(state.sequence, token_ids, room, self.config.speculative_min_ngram, self.config.speculative_max_ngram)
