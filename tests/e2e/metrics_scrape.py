"""Prometheus /metrics pages read back in tests: every sample, and sums over labels."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page: (name, sorted labels) -> value."""
    text = httpx.get(url, timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of `name` over the samples whose labels include `labels`."""
    return sum(value for (sample, sample_labels), value in samples.items()
               if sample == name and set(labels.items()) <= set(sample_labels))
