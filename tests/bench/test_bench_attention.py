"""The attention benchmark builds its cases on disjoint pages and prints each against its bound."""

from __future__ import annotations

import re
import sys

import pytest

from bench import bench_attention
from bench import bounds as machine
from worker_service import native

pytestmark = pytest.mark.skipif(native.load() is None, reason="the compiled kernel does not build here")


def test_copies_use_disjoint_pages_and_cover_the_cycle() -> None:
    copies, num_pages = bench_attention.copies_of_cases(8 << 20)
    used: list[int] = []
    for case_copies in copies:
        assert len(case_copies) * case_copies[0].bytes >= min(8 << 20, bench_attention.MAX_COPIES * case_copies[0].bytes)
        for case in case_copies:
            pages = [p for table in case.tables for p in table] + [p for *_, table in case.spans for p in table]
            used.extend(set(pages))
    assert len(used) == len(set(used)) == num_pages  # no page in two copies, none left over


def test_prints_every_case_with_its_fraction_of_the_bound(monkeypatch, capsys) -> None:
    fixed = machine.MachineBounds(50e9, {"bfloat16": 900e9})
    monkeypatch.setattr(machine, "measure", lambda names: fixed)
    monkeypatch.setattr(sys, "argv", ["bench_attention", "--threads", "1", "--repeats", "1", "--calls", "2",
                                      "--cycle-mb", "1"])
    bench_attention.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("bounds (best of start and end): read bandwidth 50.0 GB/s; GEMM bfloat16 900 GFLOP/s")
    assert len(lines) == 1 + len(bench_attention.BUILDERS)
    for line in lines[1:]:
        assert re.fullmatch(r" *[\w ()+x]+: +\d+\.\d us a call, +\d+\.\d GFLOP/s, +\d+\.\d GB/s; +\d+% of its bound "
                            r"\((FLOPs|bytes)\)", line), line
