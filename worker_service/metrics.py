"""A worker rank's Prometheus metrics: forward time by step kind, tokens per step, sampler time,
and which backend the rank runs (`worker_backend_info`, 1 for the rank's backend).

A step is `prefill` when every entry is a prompt chunk of more than one token, `decode` when
every entry computes one token, `mixed` otherwise (chunked prefill beside decodes). Every
rank records its own forward time; only rank 0 samples.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Gauge

from radixserve.metrics import MODEL_LABEL, count_histogram, gap_histogram, latency_histogram, name

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
        r = self.registry
        self.forward = latency_histogram(
            r, "worker_forward_duration_seconds", "One forward pass over a step's entries.", ["rank", "step_kind"])
        self.tokens = count_histogram(r, "worker_step_tokens", "Tokens computed in one forward pass.", ["rank"])
        self.sampler = latency_histogram(
            r, "worker_sampler_duration_seconds", "Sampling one step's tokens (rank 0).", ["rank"])
        self.backend = Gauge(name("worker_backend_info"), "The backend this rank runs (1 for its name).",
                             [MODEL_LABEL, "rank", "backend"], registry=r)
        self.quantization = Gauge(name("worker_quantization_info"),
                                  "The weights' quantization this rank serves (1 for its name).",
                                  [MODEL_LABEL, "rank", "quantization"], registry=r)
        self.idle = gap_histogram(
            r, "worker_idle_between_tasks_seconds",
            "Time the task thread waited between two tasks (also when the router had nothing to "
            "send; the router's worker_idle_between_steps_seconds counts back-to-back steps only).",
            ["rank"])

    def forward_done(self, num_tokens_per_entry: Sequence[int], seconds: float) -> None:
        kind = step_kind(num_tokens_per_entry)
        self.forward.labels(*self._labels, kind).observe(seconds)
        self.tokens.labels(*self._labels).observe(sum(num_tokens_per_entry))

    def backend_chosen(self, name: str) -> None:
        self.backend.labels(*self._labels, name).set(1)

    def quantization_served(self, quantization: str) -> None:
        self.quantization.labels(*self._labels, quantization).set(1)

    def idle_done(self, seconds: float) -> None:
        self.idle.labels(*self._labels).observe(seconds)

    def sampler_done(self, seconds: float) -> None:
        self.sampler.labels(*self._labels).observe(seconds)
