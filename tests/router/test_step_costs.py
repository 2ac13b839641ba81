"""The step-cost figures: medians over recent steps, sums, and one log line per busy period."""

from __future__ import annotations

import logging

import pytest

from router_service.core.step_costs import RECENT_STEPS, StepCosts


def test_medians_sums_and_the_busy_period_line(caplog: pytest.LogCaptureFixture) -> None:
    costs = StepCosts()
    costs.step_done(0.0004, None)  # the first step after idle: no idle figure
    for idle_s in (0.0001, 0.0003, 0.0002):
        costs.step_done(0.0005, idle_s)
    idle, cpu = costs.worker_idle.stats(), costs.router_cpu.stats()
    assert (idle.p50_s, idle.num_steps) == (0.0002, 3)
    assert idle.total_s == pytest.approx(0.0006)
    assert (cpu.p50_s, cpu.num_steps) == (0.0005, 4)
    with caplog.at_level(logging.INFO, logger="router_service.core.step_costs"):
        costs.end_busy_period(overlap=True)
        costs.end_busy_period(overlap=True)  # nothing ran since: no second line
    (line,) = caplog.messages
    assert "busy period of 4 steps (overlap on)" in line
    assert "0.200 ms between steps (median of 3 back to back), 0.6 ms in all" in line
    assert costs.worker_idle.stats().num_steps == 3  # the period ends, the totals stay


def test_the_median_follows_recent_steps() -> None:
    costs = StepCosts()
    for _ in range(RECENT_STEPS):
        costs.step_done(0.001, 0.010)
    for _ in range(RECENT_STEPS // 2 + 1):
        costs.step_done(0.001, 0.0001)
    assert costs.worker_idle.stats().p50_s == 0.0001
