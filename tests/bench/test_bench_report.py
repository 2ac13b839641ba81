"""The benchmark's arithmetic and report, on hand-made records (no server, no model)."""

from __future__ import annotations

from pathlib import Path

from bench.records import RequestRecord, percentile, summarize
from bench.report import TABLE_END, TABLE_START, markdown, update_docs, write_report
from bench.workloads import distinct_prompts, multi_turn, shared_system_prompt
from procs import ROOT


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 51.0
    assert percentile(values, 99) == 99.0
    assert percentile([], 50) is None


def test_summarize_counts_tokens_latencies_and_hits() -> None:
    first = RequestRecord(0, 0, start_s=0.0, end_s=1.0, first_token_s=0.2,
                          token_times_s=[0.2, 0.3, 0.5], prompt_tokens=100, completion_tokens=3,
                          cached_tokens=80)
    second = RequestRecord(1, 0, start_s=0.0, end_s=2.0, first_token_s=0.4,
                           token_times_s=[0.4, 0.6], prompt_tokens=100, completion_tokens=2,
                           cached_tokens=0)
    failed = RequestRecord(2, 0, start_s=0.0, error="UNAVAILABLE: gone")
    summary = summarize([first, second, failed], wall_s=2.0)
    assert summary["num_errors"] == 1
    assert summary["completion_tokens"] == 5
    assert summary["output_tokens_per_s"] == 2.5
    assert summary["total_tokens_per_s"] == 102.5
    assert summary["cache_hit_rate"] == 0.4
    assert (summary["ttft_p50_ms"], summary["ttft_p99_ms"]) == (200.0, 400.0)
    # Gaps between tokens: 100 and 200 ms in the first request, 200 ms in the second.
    assert (summary["itl_p50_ms"], summary["itl_p99_ms"]) == (200.0, 200.0)


def test_workload_variants_never_repeat_requests() -> None:
    a, b = distinct_prompts(4, 8, variant=0), distinct_prompts(4, 8, variant=1)
    assert not {t for c in a.conversations for t in c} & {t for c in b.conversations for t in c}
    s0, s1 = shared_system_prompt(4, 8, variant=0), shared_system_prompt(4, 8, variant=1)
    assert s0.system_prompt == s1.system_prompt
    assert s0.conversations != s1.conversations
    assert multi_turn(2, 3, 8).num_requests == 6


def test_report_has_ratios_and_plots(tmp_path: Path) -> None:
    row = {"output_tokens_per_s": 80.0, "total_tokens_per_s": 900.0, "ttft_p50_ms": 100.0,
           "ttft_p99_ms": 150.0, "itl_p50_ms": 30.0, "itl_p99_ms": 40.0, "cache_hit_rate": 0.9}
    peer = {**row, "output_tokens_per_s": 20.0, "ttft_p50_ms": 1000.0, "cache_hit_rate": None}
    report = {
        "date": "2026-01-01 00:00 UTC", "machine": "test", "model": "m", "tp": 1, "dtype": "float32",
        "radixserve": {"results": [{"workload": "shared_prefix", "concurrency": c, **row} for c in (1, 4)],
                       "worker_peak_rss_mb": [1000.0]},
        "transformers": {"results": [{"workload": "shared_prefix", "concurrency": c, **peer} for c in (1, 4)],
                         "peak_rss_mb": 900.0},
    }
    text = markdown(report)
    assert "| shared_prefix | 4 | radixserve | 80.0 |" in text
    assert "4.00x" in text and "10.00x" in text
    assert "HTTP API against gRPC" not in text
    slower = {**row, "ttft_p50_ms": 110.0, "itl_p50_ms": 33.0, "output_tokens_per_s": 75.0}
    report["radixserve"]["http_results"] = [{"workload": "shared_prefix", "concurrency": 4, **slower}]
    text = markdown(report)
    assert "| shared_prefix | 4 | 100.0 / 110.0 | +10.0 ms (1.10x) | 30.0 / 33.0 | +3.0 ms (1.10x) | 80.0 / 75.0 |" in text
    report["radixserve"]["http_paired"] = {
        "num_pairs": 20, "max_tokens": 16, "ttft_p50_ms": {"grpc": 50.0, "http": 52.0, "ratio": 1.04},
        "itl_p50_ms": {"grpc": 20.0, "http": 20.5, "ratio": 1.025}}
    assert "TTFT p50 gRPC 50.0 / HTTP 52.0 ms (1.04x); ITL p50 gRPC 20.0 / HTTP 20.5 ms (1.025x)" in markdown(report)
    write_report(report, tmp_path)
    for name in ("latest.json", "latest.md", "throughput.png", "ttft.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_update_docs_replaces_only_the_table_between_the_markers(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# Benchmarks\n\nbefore\n{TABLE_START}\nold table\n{TABLE_END}\n\nafter\n")
    assert update_docs(page, "| new | table |\n")
    assert page.read_text() == f"# Benchmarks\n\nbefore\n{TABLE_START}\n| new | table |\n{TABLE_END}\n\nafter\n"
    page.write_text("# no markers\n")
    assert not update_docs(page, "| new | table |\n")
    assert page.read_text() == "# no markers\n"


def test_make_bench_updates_the_benchmarks_page_which_has_the_markers() -> None:
    from bench.run_all import BENCHMARKS_PAGE

    text = BENCHMARKS_PAGE.read_text()
    assert BENCHMARKS_PAGE.relative_to(ROOT).as_posix() == "docs/benchmarks.md"
    assert text.count(TABLE_START) == 1 and text.count(TABLE_END) == 1
    assert text.index(TABLE_START) < text.index(TABLE_END)
    makefile = (ROOT / "Makefile").read_text()
    assert "bench.run_all --update-docs" in makefile


def test_sampling_settings_reach_every_engine_and_the_report() -> None:
    import argparse

    from bench.peer_transformers import sampling_kwargs
    from bench.run_all import build_jobs

    args = argparse.Namespace(quick=True, concurrency=[2], num_requests=2, max_tokens=4, system_prompt_words=20,
                              distinct_words=10, single_stream_tokens=8, skip_multi_turn=False,
                              temperature=0.7, top_p=0.9)
    jobs = build_jobs(args)
    assert len(jobs) == 4 and all((w.temperature, w.top_p) == (0.7, 0.9) for w, _ in jobs)
    assert sampling_kwargs(jobs[0][0]) == {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 0}
    greedy = build_jobs(argparse.Namespace(**{**vars(args), "temperature": 0.0, "top_p": 1.0}))
    assert sampling_kwargs(greedy[0][0]) == {"do_sample": False}
    report = {"date": "d", "machine": "m", "model": "m", "tp": 1, "dtype": "bfloat16",
              "radixserve": {"results": [], "worker_peak_rss_mb": []}}
    assert "TP=1, greedy." in markdown(report)
    report["sampling"] = {"temperature": 0.7, "top_p": 0.9}
    assert "TP=1, sampled at temperature 0.7, top_p 0.9." in markdown(report)
