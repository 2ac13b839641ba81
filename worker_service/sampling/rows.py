"""What the sampler takes and gives per row: the leaf types every sampling module shares."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from radixserve.sampling import SamplingParams


# Not frozen: one is built for every row of every step, and a frozen dataclass's __init__
# (object.__setattr__ per field) costs several times a plain one's.
@dataclass(slots=True)
class SampleRow:
    """What the sampler needs of one request this step.

    `token_ids` is the request's whole sequence so far (cached prefix, prompt and output tokens
    whose K/V is written); positions `[0, num_prompt_tokens)` are prompt, the rest output.
    `history`, where given, holds the same ids as int32 from its start (it may run on, past
    `len(token_ids)`): the request state's own copy, which the compiled penalties read in place
    instead of converting the sequence every step.
    """

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    history: array | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """The seeded generator's step (counted, not sliced: a step costs no copy of the output)."""
        return max(0, len(self.token_ids) - self.num_prompt_tokens)


# Not frozen, as SampleRow: one for every row of every step.
@dataclass(slots=True)
class Sample:
    """One drawn token; `logprob` and `top_logprobs` are filled only when asked for."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
