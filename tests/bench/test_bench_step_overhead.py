"""The step-overhead benchmark runs the executor end to end on a tiny setting and prints its verdict."""

from __future__ import annotations

import re
import sys

from bench import bench_step_overhead


def test_prints_a_median_per_context_and_the_ratio(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_step_overhead", "--batch", "2", "--contexts", "40,20", "--steps", "3"])
    bench_step_overhead.main()
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"batch 2, context +20: decode step +\d+ us \(median\)", lines[0])
    assert re.fullmatch(r"batch 2, context +40: decode step +\d+ us \(median\)", lines[1])
    assert re.fullmatch(r"context 40 / 20: \d+\.\d\dx \(goal <= 1\.5x: (met|NOT met)\)", lines[2])
