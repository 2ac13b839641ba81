"""Resolved sampling settings: the one value the router carries and the worker's sampler obeys.

The gateway resolves the public API's optional fields into these (see generation.proto for the
documented defaults); the router passes them through untouched; rank 0's sampler applies them.
On the wire they are `radixserve.v1.ResolvedSamplingParams`; `to_proto` / `from_proto` are the
only mapping. `RANGES` and `SamplingParams.problems` are the one declaration of what a value may
be: the gateway (public requests), the router (its callers) and the workers (their tasks) all
check with them, so the three can never disagree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from radixserve.v1 import worker_pb2

MAX_TOP_LOGPROBS = 20
# OpenAI's bound on a logit bias: -100 bans a token, 100 all but forces it.
MAX_LOGIT_BIAS = 100.0
# Most biased tokens per request (OpenAI's bound as well): bounds the sampler's work per row.
MAX_LOGIT_BIAS_TOKENS = 300
SEED_MASK = (1 << 64) - 1  # seeds are unsigned 64-bit on the wire


@dataclass(frozen=True, slots=True)
class Range:
    """A closed interval, or half-open at the bottom when `low_open`."""

    low: float
    high: float
    low_open: bool = False

    def problem(self, name: str, value: float) -> str | None:
        """What is wrong with `value` for the field `name`; None when it is in range."""
        if not math.isfinite(value):
            return f"{name} must be a finite number, got {value}"
        below = value <= self.low if self.low_open else value < self.low
        if below or value > self.high:
            return f"{name} must be in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}], got {value:g}"
        return None


# The ranges generation.proto documents for the public SamplingParams.
RANGES = {
    "temperature": Range(0.0, 2.0),
    "top_p": Range(0.0, 1.0, low_open=True),
    "min_p": Range(0.0, 1.0),
    "repetition_penalty": Range(0.0, 2.0, low_open=True),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
}


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """One request's sampling settings with every default resolved.

    temperature 0 is greedy; top_k 0, top_p 1, min_p 0, repetition_penalty 1 and zero
    presence/frequency penalties switch those steps off. `seed` None means unseeded.
    `logit_bias` holds (token id, bias) pairs sorted by token id (a tuple: the value is frozen).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def has_penalties(self) -> bool:
        """Whether any of the three penalties is on (the sampler skips them otherwise)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def problems(self) -> list[str]:
        """What is wrong with these values, one message per field (empty when they are usable)."""
        found = [problem for name, bounds in RANGES.items() if (problem := bounds.problem(name, getattr(self, name)))]
        if self.top_k < 0:
            found.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            found.append(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if (problem := seed_problem(self.seed)) is not None:
            found.append(problem)
        found.extend(logit_bias_problems(self.logit_bias))
        return found


def logit_bias_problems(bias: Iterable[tuple[int, float]], vocab_size: int | None = None) -> list[str]:
    """What is wrong with a logit bias's pairs: ids below 0 (or past `vocab_size` when known),
    values outside [-100, 100]. At most one message per kind, naming the first offender."""
    found = []
    bias = list(bias)
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        found.append(f"logit_bias: at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}")
    bad_id = next((token_id for token_id, _ in bias
                   if token_id < 0 or (vocab_size is not None and token_id >= vocab_size)), None)
    if bad_id is not None:
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        found.append(f"logit_bias: token id {bad_id} must be {bound}")
    bounds = Range(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    bad = next((problem for token_id, value in bias
                if (problem := bounds.problem(f"logit_bias[{token_id}]", value))), None)
    if bad is not None:
        found.append(bad)
    return found


def seed_problem(seed: int | None) -> str | None:
    """Seeds are unsigned 64-bit on the wire; the HTTP API's JSON can carry any integer."""
    if seed is not None and not 0 <= seed <= SEED_MASK:
        return f"seed must be in [0, 2^64), got {seed}"
    return None


def from_proto(message: worker_pb2.ResolvedSamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=message.top_p,
        min_p=message.min_p,
        repetition_penalty=message.repetition_penalty,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        seed=message.seed if message.has_seed else None,
        logprobs=message.logprobs,
        top_logprobs=message.top_logprobs,
        logit_bias=tuple(sorted(message.logit_bias.items())),
    )


def to_proto(params: SamplingParams) -> worker_pb2.ResolvedSamplingParams:
    return worker_pb2.ResolvedSamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        has_seed=params.seed is not None,
        seed=params.seed or 0,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
        logit_bias=dict(params.logit_bias),
    )
