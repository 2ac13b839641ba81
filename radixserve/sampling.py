"""Resolved sampling settings: the one value the router carries and the worker's sampler obeys.

The gateway resolves the public API's optional fields into these (see generation.proto for the
documented defaults); the router passes them through untouched; rank 0's sampler applies them.
On the wire they are `radixserve.v1.ResolvedSamplingParams`; `to_proto` / `from_proto` are the
only mapping.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.v1 import worker_pb2

MAX_TOP_LOGPROBS = 20
SEED_MASK = (1 << 64) - 1  # seeds are unsigned 64-bit on the wire


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """One request's sampling settings with every default resolved.

    temperature 0 is greedy; top_k 0, top_p 1, min_p 0, repetition_penalty 1 and zero
    presence/frequency penalties switch those steps off. `seed` None means unseeded.
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

    def problems(self) -> list[str]:
        """What is wrong with these values (empty when they are usable)."""
        found = []
        finite = {
            "temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        for name, value in finite.items():
            if value != value or value in (float("inf"), float("-inf")):
                found.append(f"{name} must be finite, got {value}")
        if self.temperature < 0:
            found.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            found.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            found.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            found.append(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            found.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            found.append(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.seed is not None and not 0 <= self.seed <= SEED_MASK:
            found.append(f"seed must fit in 64 unsigned bits, got {self.seed}")
        return found


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
    )
