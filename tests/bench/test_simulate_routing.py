"""The routing simulator on a tiny skewed trace: every request served, the bounded-load policy
within its bound, prefix affinity keeping more of the cache than round robin."""

from __future__ import annotations

import re
import sys

import pytest

from bench import simulate_routing
from bench.routing_policies import BoundedLoad, CacheAware, LeastLoaded, PrefixAffinity, RoundRobin
from bench.routing_trace import TraceConfig

NUM_REPLICAS = 4
NUM_REQUESTS = 240
# One system prompt takes most of the traffic.
SKEWED = TraceConfig(num_system_prompts=8, zipf_exponent=2.0, system_len=(128, 256), user_len=(16, 64),
                     output_len=(4, 16))
REPLICA = simulate_routing.ReplicaConfig(num_pages=256)


@pytest.fixture(scope="module")
def results() -> dict[str, simulate_routing.RunResult]:
    capacity = simulate_routing.capacity_per_replica(SKEWED, REPLICA, seed=3)
    rate = 0.9 * capacity * NUM_REPLICAS
    policies = [RoundRobin(NUM_REPLICAS), LeastLoaded(NUM_REPLICAS), PrefixAffinity(NUM_REPLICAS),
                BoundedLoad(NUM_REPLICAS, bound=1.25), CacheAware(NUM_REPLICAS)]
    return {
        policy.name: simulate_routing.simulate(policy, NUM_REPLICAS, NUM_REQUESTS, rate, SKEWED, REPLICA, seed=3)
        for policy in policies
    }


@pytest.mark.timeout(300)
def test_every_request_is_routed_and_served(results) -> None:
    for result in results.values():
        assert result.num_requests == result.num_completed == NUM_REQUESTS
        assert 0 < result.late_hit_rate < 1
        assert 0 < result.ttft_p50_s <= result.ttft_p99_s
        assert result.continued_share > 0.2  # sessions came back with their history


@pytest.mark.timeout(300)
def test_bounded_load_stays_within_its_bound_where_affinity_does_not(results) -> None:
    bounded = results["bounded load"]
    # The capacity is rounded down to whole requests, but never below the mean rounded up: the
    # busiest may hold up to one request more than 1.25 times the mean.
    assert bounded.busiest_over_mean <= 1.25 + 1 / bounded.mean_load
    assert bounded.mean_load > 8  # busy enough for that request to be a small part
    assert results["prefix affinity"].busiest_over_mean > 1.5  # the hot prompt's replica


@pytest.mark.timeout(300)
def test_affinity_keeps_more_of_the_cache_than_round_robin(results) -> None:
    assert results["prefix affinity"].hit_rate >= results["round robin"].hit_rate
    assert results["bounded load"].hit_rate >= results["round robin"].hit_rate


@pytest.mark.timeout(300)
def test_main_prints_every_policy_and_the_decision_cost(monkeypatch, capsys) -> None:
    monkeypatch.setattr(simulate_routing, "CALIBRATION_REQUESTS", 40)
    monkeypatch.setattr(sys, "argv", ["simulate_routing", "--replicas", "2", "--requests-per-replica", "20",
                                      "--loads", "0.7", "--decision-prompts", "20"])
    simulate_routing.main()
    out = capsys.readouterr().out
    for name in ("round robin", "least loaded", "prefix affinity", "bounded, no memory", "bounded load", "cache aware"):
        assert re.search(rf"70% {name} +\d+\.\d% +\d+\.\d +\d+\.\d +\d+\.\d\d +\d+\.\d +\d+% +\d+\.\d%", out), out
        assert re.search(rf"{name} +8 replicas +\d+\.\d +512 replicas +\d+\.\d", out), out


@pytest.mark.timeout(300)
def test_copies_and_moved_turns_count_what_each_policy_spreads(results) -> None:
    # Pure affinity keys on the system prompt: one replica per prompt, a session never moves.
    affinity = results["prefix affinity"]
    assert affinity.prompt_copies == 1.0 and affinity.moved_share == 0.0
    # Round robin puts every prompt on every replica and moves most turns; bounded load spills
    # the hot prompt over a few replicas.
    assert results["round robin"].prompt_copies > results["bounded load"].prompt_copies > 1.0
    assert results["round robin"].moved_share > 0.5


@pytest.mark.timeout(300)
def test_main_runs_the_policies_asked_for_with_the_gateways_settings_from_its_environment(
        monkeypatch, capsys) -> None:
    monkeypatch.setattr(simulate_routing, "CALIBRATION_REQUESTS", 40)
    monkeypatch.setenv("RADIXSERVE_RECOMPUTE_TOKENS", "0")
    monkeypatch.setenv("RADIXSERVE_PREFIX_MEMORY_HOLDERS", "3")
    simulate_routing.main(["--replicas", "2", "--requests-per-replica", "20", "--loads", "0.7",
                           "--decision-prompts", "0", "--policy", "bounded load", "--policy", "prefix affinity"])
    out = capsys.readouterr().out
    assert "prefix memory: 3 replicas per prefix" in out and "0 prompt tokens to recompute" in out
    assert re.search(r"70% bounded load +\d+\.\d%", out) and re.search(r"70% prefix affinity +\d+\.\d%", out)
    assert "round robin" not in out and "cache aware" not in out and "goal" not in out
    assert "microseconds per routing decision" not in out
