"""LoopHistogram exposes what prometheus-client's Histogram does for the same observations."""

from __future__ import annotations

import math
import threading

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from radixserve.loop_histogram import LoopHistogram
from radixserve.metrics import LATENCY_BUCKETS_S

NAME, DOC, LABELS = "radixserve:inter_token_latency_seconds", "Between consecutive tokens of one request.", \
    ("model_name", "api")
AMOUNTS = st.one_of(st.sampled_from([0.0, *LATENCY_BUCKETS_S, 1e9, -1.0, math.inf]),
                    st.floats(min_value=-1.0, max_value=100.0, allow_nan=False))


def both() -> tuple[CollectorRegistry, Histogram, CollectorRegistry, LoopHistogram]:
    reference, ours = CollectorRegistry(), CollectorRegistry()
    return (reference, Histogram(NAME, DOC, LABELS, buckets=LATENCY_BUCKETS_S, registry=reference),
            ours, LoopHistogram(NAME, DOC, LABELS, LATENCY_BUCKETS_S, ours))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grpc", "completions"]), AMOUNTS), max_size=60))
def test_exposes_the_same_text_as_prometheus_clients_histogram(observations) -> None:
    reference_registry, reference, registry, histogram = both()
    for model, api in (("m", "grpc"), ("m", "completions"), ("m", "embeddings")):  # declared at 0
        reference.labels(model, api)
        histogram.labels(model, api)
    for api, amount in observations:
        reference.labels("m", api).observe(amount)
        histogram.labels("m", api).observe(amount)
    assert generate_latest(registry).decode() == generate_latest(reference_registry).decode()


def test_a_nan_counts_in_the_sum_alone_as_prometheus_client_has_it() -> None:
    reference_registry, reference, registry, histogram = both()
    for series in (reference.labels("m", "grpc"), histogram.labels("m", "grpc")):
        series.observe(0.003)
        series.observe(math.nan)
    assert generate_latest(registry).decode() == generate_latest(reference_registry).decode()
    assert histogram.labels("m", "grpc").counts[2] == 1 and sum(histogram.labels("m", "grpc").counts) == 1


def test_wrong_label_count_and_a_second_registration_are_refused() -> None:
    registry = CollectorRegistry()
    histogram = LoopHistogram(NAME, DOC, LABELS, LATENCY_BUCKETS_S, registry)
    with pytest.raises(ValueError, match="2 label values expected"):
        histogram.labels("m")
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Histogram(NAME, DOC, LABELS, registry=registry)

def test_a_scrape_during_observations_sees_buckets_that_add_up() -> None:
    """Scrapes come from prometheus-client's server thread while the loop observes."""
    registry = CollectorRegistry()
    histogram = LoopHistogram(NAME, DOC, LABELS, LATENCY_BUCKETS_S, registry)
    series = histogram.labels("m", "grpc")
    done = threading.Event()

    def observe() -> None:
        for i in range(200_000):
            series.observe((i % 50) / 1000)
        done.set()

    thread = threading.Thread(target=observe)
    thread.start()
    scrapes = 0
    while not done.is_set() and scrapes < 500:
        metric, = histogram.collect()
        buckets = [s.value for s in metric.samples if s.name.endswith("_bucket")]
        count = next(s.value for s in metric.samples if s.name.endswith("_count"))
        assert buckets == sorted(buckets) and buckets[-1] == count
        scrapes += 1
    thread.join(timeout=60)
    assert not thread.is_alive() and scrapes > 0
    metric, = histogram.collect()
    assert next(s.value for s in metric.samples if s.name.endswith("_count")) == 200_000
