"""What steps cost besides the forward pass: the worker ranks' idle time between consecutive
steps (what overlap scheduling removes) and the router's own CPU time per step.

Each rank measures, per task, the time between finishing the task before it and starting it
(`TaskResult.idle_before_s`; the group reports the slowest rank's). Only steps the router sent
back to back count: a gap in which the router had nothing to send is not a cost. The router's
CPU per step is the event loop thread's CPU time spent planning the step (schedule, task
message) and applying its result (tokens, endings, events to the callers' streams); the gRPC
library's own threads and the callers' stream handlers are not in it. The figures feed GetStats
(median of the recent steps, and sums), the metrics histograms, and one log line per busy period
(from the first step after the router was idle to the next idle).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Medians are over this many recent steps: recent enough to follow a change of load, enough
# to be stable.
RECENT_STEPS = 1024
# The newest step's weight in the step time reported to gateways (`StepCosts.step_time_s`): an
# exponentially weighted mean follows a change of load within tens of steps, at no cost per read.
STEP_TIME_WEIGHT = 0.1
SECONDS_PER_MS = 1e-3


@dataclass(frozen=True, slots=True)
class FigureStats:
    p50_s: float = 0.0
    total_s: float = 0.0
    num_steps: int = 0


class RecentFigures:
    """Seconds per step: the median of the recent ones, the sum and the count of all."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self._total_s = 0.0
        self._num_steps = 0

    def record(self, seconds: float) -> None:
        self._recent.append(seconds)
        self._total_s += seconds
        self._num_steps += 1

    def stats(self) -> FigureStats:
        p50 = statistics.median(self._recent) if self._recent else 0.0
        return FigureStats(p50, self._total_s, self._num_steps)


class StepCosts:
    """The engine's record of worker idle time and router CPU per step."""

    def __init__(self) -> None:
        self.worker_idle = RecentFigures()
        self.router_cpu = RecentFigures()
        self._period_idle: list[float] = []
        self._period_cpu: list[float] = []
        self.step_time_s = 0.0  # wall time per step, weighted towards the recent ones

    def step_time(self, seconds: float) -> None:
        """A step's wall time: from its send, or from the result before it when it was sent
        earlier (overlap), to its result."""
        previous = self.step_time_s
        self.step_time_s = seconds if previous == 0.0 else previous + STEP_TIME_WEIGHT * (seconds - previous)

    def step_done(self, router_cpu_s: float, worker_idle_s: float | None) -> None:
        """A step's result was applied; `worker_idle_s` None: not sent back to back."""
        self.router_cpu.record(router_cpu_s)
        self._period_cpu.append(router_cpu_s)
        if worker_idle_s is not None:
            self.worker_idle.record(worker_idle_s)
            self._period_idle.append(worker_idle_s)

    def end_busy_period(self, overlap: bool) -> None:
        """The router ran out of work: log this busy period's figures (once per period)."""
        idle, cpu = self._period_idle, self._period_cpu
        self._period_idle, self._period_cpu = [], []
        if not cpu:
            return
        log.info(
            "busy period of %d steps (overlap %s): workers idled %.3f ms between steps (median "
            "of %d back to back), %.1f ms in all; router CPU %.3f ms per step (median)",
            len(cpu), "on" if overlap else "off",
            statistics.median(idle) / SECONDS_PER_MS if idle else 0.0, len(idle),
            sum(idle) / SECONDS_PER_MS, statistics.median(cpu) / SECONDS_PER_MS,
        )
