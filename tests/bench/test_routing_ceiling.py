"""The hit-rate ceiling (bench/routing_ceiling.py): what it counts by hand, and that no simulated
policy's cache ever served more than it allows."""

from __future__ import annotations

import pytest

from bench import simulate_routing
from bench.routing_ceiling import Served, cacheable, hit_rate_ceiling
from bench.routing_policies import BoundedLoad, CacheAware, PrefixAffinity, RoundRobin
from bench.routing_trace import TraceConfig

PAGE = 16


def test_the_cache_serves_whole_pages_and_never_the_last_token() -> None:
    assert cacheable(100, 500, PAGE) == 96
    assert cacheable(500, 500, PAGE) == 496  # all but the last token: 499, in whole pages
    assert cacheable(0, 500, PAGE) == 0


def test_a_prompt_heavier_than_a_replicas_share_is_computed_once_more_per_replica_it_needs() -> None:
    # System prompt "a" (160 tokens) carries 8 of 10 seconds of load over 4 replicas: within a
    # bound of 1.25 one replica carries at most 3.125, so "a" needs 3 replicas, 2 more copies.
    requests = [Served("a", 160, 400, 0, 2.0)] + [Served("a", 160, 400, 160, 2.0)] * 3 + [
        Served("b", 320, 400, 0, 1.0), Served("b", 320, 600, 400, 1.0)]
    prompt_tokens = 4 * 400 + 400 + 600
    shared = 3 * 160 + 400  # "a" three times after the first; "b"'s second turn, its whole history
    assert hit_rate_ceiling(requests, 4, 1.25, PAGE) == pytest.approx((shared - 2 * 160) / prompt_tokens)
    # With room for everything on one replica, only what no earlier prompt had is missed.
    assert hit_rate_ceiling(requests, 4, 100.0, PAGE) == pytest.approx(shared / prompt_tokens)


def test_a_prompt_is_never_counted_on_more_replicas_than_it_has_requests() -> None:
    # One request of "a" carries all the load: it needs 4 replicas by load, but runs on one.
    requests = [Served("a", 160, 400, 0, 9.0), Served("b", 160, 400, 0, 0.1), Served("b", 160, 400, 160, 0.1)]
    assert hit_rate_ceiling(requests, 4, 1.25, PAGE) == pytest.approx(160 / 1200)


def test_no_requests_is_an_error() -> None:
    with pytest.raises(ValueError, match="no requests"):
        hit_rate_ceiling([], 4, 1.25, PAGE)


@pytest.mark.timeout(300)
def test_no_policy_serves_more_from_the_cache_than_the_ceiling_allows(monkeypatch) -> None:
    # One system prompt takes most of the traffic. With the bound lifted, the ceiling is every
    # token some earlier prompt had: no policy's cache may serve more.
    trace = TraceConfig(num_system_prompts=8, zipf_exponent=2.0, system_len=(128, 256), user_len=(16, 64),
                        output_len=(4, 16))
    replica = simulate_routing.ReplicaConfig(num_pages=256)
    capacity = simulate_routing.capacity_per_replica(trace, replica, seed=3)
    policies = [RoundRobin(4), PrefixAffinity(4), BoundedLoad(4, bound=1.25), CacheAware(4)]
    unbounded = {}
    monkeypatch.setattr(simulate_routing, "BUSIEST_GOAL", 1e9)
    for policy in policies:
        result = unbounded[policy.name] = simulate_routing.simulate(
            policy, 4, 240, 0.9 * capacity * 4, trace, replica, seed=3)
        assert 0 < result.hit_rate <= result.hit_ceiling, policy.name
    # Affinity keeps one replica per prompt and its conversations where they were: it serves
    # nearly all of it; round robin far less.
    assert unbounded["prefix affinity"].hit_rate > 0.98 * unbounded["prefix affinity"].hit_ceiling
    assert unbounded["round robin"].hit_rate < 0.9 * unbounded["round robin"].hit_ceiling
    # Balance costs hit rate: within 1.25 of the mean the hot prompt is computed on more
    # replicas, so its ceiling is lower than the unbounded one.
    monkeypatch.setattr(simulate_routing, "BUSIEST_GOAL", 1.25)
    affinity = simulate_routing.simulate(PrefixAffinity(4), 4, 240, 0.9 * capacity * 4, trace, replica, seed=3)
    assert affinity.busiest_over_mean > 1.5
    assert affinity.hit_ceiling < unbounded["prefix affinity"].hit_ceiling
