"""A worker rank's Prometheus metrics: forward time by step kind, tokens per step, sampler time.

A step is `prefill` when every entry is a prompt chunk of more than one token, `decode` when
every entry computes one token, `mixed` otherwise (chunked prefill beside decodes). Every
rank records its own forward time; only rank 0 samples.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Histogram

from radixserve.metrics import COUNT_BUCKETS, LATENCY_BUCKETS_S, MODEL_LABEL, name

STEP_PREFILL = "prefill"
STEP_DECODE = "decode"
STEP_MIXED = "mixed"


def step_kind(num_tokens_per_entry: Sequence[int]) -> str:
    if all(n == 1 for n in num_tokens_per_entry):
        return STEP_DECODE
    if all(n > 1 for n in num_tokens_per_entry):
        return STEP_PREFILL
    return STEP_MIXED


class WorkerMetrics:
    def __init__(self, model_name: str, rank: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._labels = (model_name, str(rank))
        labels = [MODEL_LABEL, "rank"]
        self.forward = Histogram(
            name("worker_forward_duration_seconds"), "One forward pass over a step's entries.",
            [*labels, "step_kind"], buckets=LATENCY_BUCKETS_S, registry=self.registry,
        )
        self.tokens = Histogram(
            name("worker_step_tokens"), "Tokens computed in one forward pass.",
            labels, buckets=COUNT_BUCKETS, registry=self.registry,
        )
        self.sampler = Histogram(
            name("worker_sampler_duration_seconds"), "Sampling one step's tokens (rank 0).",
            labels, buckets=LATENCY_BUCKETS_S, registry=self.registry,
        )

    def forward_done(self, num_tokens_per_entry: Sequence[int], seconds: float) -> None:
        kind = step_kind(num_tokens_per_entry)
        self.forward.labels(*self._labels, kind).observe(seconds)
        self.tokens.labels(*self._labels).observe(sum(num_tokens_per_entry))

    def sampler_done(self, seconds: float) -> None:
        self.sampler.labels(*self._labels).observe(seconds)
