"""Turn a benchmark run into `latest.json`, a Markdown table (`latest.md`) and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

# Goals from the benchmark issue: (workload, figure, ratio wanted).
GOALS = {
    "shared_prefix": "output ≥ 8x, TTFT p50 ≥ 10x lower",
    "distinct": "output ≥ 1.8x",
    "single_stream": "output ≥ 2.2x",
    "multi_turn": "(no goal)",
}


def _index(results: list[dict]) -> dict[tuple[str, int], dict]:
    return {(r["workload"], r["concurrency"]): r for r in results}


def _ratio(ours: float | None, theirs: float | None) -> str:
    if not ours or not theirs:
        return "n/a"
    return f"{ours / theirs:.2f}x"


def markdown(report: dict) -> str:
    ours = _index(report["radixserve"]["results"])
    peer = _index(report["transformers"]["results"])
    lines = [
        f"Measured {report['date']} on {report['machine']}; model `{report['model']}`, "
        f"{report['dtype']}, TP={report['tp']}.",
        "",
        "| workload | conc. | engine | out tok/s | total tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
        "| cache hit | out ratio | TTFT p50 ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in ours.items():
        other = peer.get(key)
        for engine, r in (("radixserve", row), ("transformers", other)):
            if r is None:
                continue
            is_ours = engine == "radixserve"
            out_ratio = _ratio(row["output_tokens_per_s"], other and other["output_tokens_per_s"]) if is_ours else ""
            ttft_ratio = _ratio(other and other["ttft_p50_ms"], row["ttft_p50_ms"]) if is_ours else ""
            hit = "" if r["cache_hit_rate"] is None else f"{100 * r['cache_hit_rate']:.0f}%"
            lines.append(
                f"| {key[0]} | {key[1]} | {engine} | {r['output_tokens_per_s']} | {r['total_tokens_per_s']} "
                f"| {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {r['itl_p50_ms']} / {r['itl_p99_ms']} "
                f"| {hit} | {out_ratio} | {ttft_ratio} |"
            )
    peaks = report["radixserve"].get("worker_peak_rss_mb") or []
    lines += [
        "",
        f"Peak memory (VmHWM): radixserve workers {', '.join(f'{p} MiB' for p in peaks) or 'n/a'}; "
        f"transformers process {report['transformers'].get('peak_rss_mb')} MiB.",
        "Ratios: output tokens/s of radixserve over transformers; TTFT p50 of transformers over radixserve.",
        "Goals: " + "; ".join(f"{k}: {v}" for k, v in GOALS.items()) + ".",
    ]
    lines += http_vs_grpc(report)
    return "\n".join(lines) + "\n"


def _cost(http_ms: float | None, grpc_ms: float | None) -> str:
    if http_ms is None or grpc_ms is None:
        return "n/a"
    return f"{http_ms - grpc_ms:+.1f} ms ({_ratio(http_ms, grpc_ms)})"


def http_vs_grpc(report: dict) -> list[str]:
    """The same workloads through the HTTP API and through gRPC on one stack: TTFT and ITL p50
    side by side, and what HTTP adds (difference and ratio). Empty when HTTP was not run."""
    http = _index(report["radixserve"].get("http_results") or [])
    if not http:
        return []
    grpc = _index(report["radixserve"]["results"])
    lines = [
        "",
        "OpenAI-compatible HTTP API against gRPC, same stack, same workloads with fresh prompts:",
        "",
        "| workload | conc. | TTFT p50 gRPC / HTTP ms | HTTP adds | ITL p50 gRPC / HTTP ms | HTTP adds "
        "| out tok/s gRPC / HTTP |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, ours in grpc.items():
        other = http.get(key)
        if other is None:
            continue
        lines.append(
            f"| {key[0]} | {key[1]} | {ours['ttft_p50_ms']} / {other['ttft_p50_ms']} "
            f"| {_cost(other['ttft_p50_ms'], ours['ttft_p50_ms'])} "
            f"| {ours['itl_p50_ms']} / {other['itl_p50_ms']} | {_cost(other['itl_p50_ms'], ours['itl_p50_ms'])} "
            f"| {ours['output_tokens_per_s']} / {other['output_tokens_per_s']} |"
        )
    pair = report["radixserve"].get("http_paired")
    if pair:
        ttft, itl = pair["ttft_p50_ms"], pair["itl_p50_ms"]
        lines += ["", f"Paired, one request at a time ({pair['num_pairs']} pairs alternating the APIs, "
                  f"cached prompt, {pair['max_tokens']} tokens): TTFT p50 gRPC {ttft['grpc']} / HTTP "
                  f"{ttft['http']} ms ({ttft['ratio']}x); ITL p50 gRPC {itl['grpc']} / HTTP {itl['http']} ms "
                  f"({itl['ratio']}x)."]
    return lines


def plot(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for figure, label, name in (("output_tokens_per_s", "output tokens/s", "throughput.png"),
                                ("ttft_p50_ms", "TTFT p50 (ms)", "ttft.png")):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, workload in zip(axes, ("shared_prefix", "distinct")):
            for engine, style in (("radixserve", "o-"), ("transformers", "s--")):
                points = sorted((r["concurrency"], r[figure]) for r in report[engine]["results"]
                                if r["workload"] == workload and r[figure] is not None)
                if points:
                    ax.plot(*zip(*points), style, label=engine)
            ax.set_title(workload)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
            ax.set_xscale("log", base=2)
            levels = sorted({r["concurrency"] for r in report["radixserve"]["results"]
                             if r["workload"] == workload})
            ax.set_xticks(levels, [str(level) for level in levels])
            if figure.startswith("ttft"):
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            if ax.lines:
                ax.legend()
        fig.suptitle(f"{label} vs concurrency — {report['date']}")
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


README_START = "<!-- BENCH:START -->"
README_END = "<!-- BENCH:END -->"


def write_report(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "latest.json").write_text(json.dumps(report, indent=2))
    (out_dir / "latest.md").write_text(markdown(report))
    plot(report, out_dir)


def update_readme(readme: Path, table: str) -> bool:
    """Put `table` between the README's benchmark markers; False when the markers are missing."""
    text = readme.read_text()
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        return False
    readme.write_text(text[: start + len(README_START)] + "\n" + table + text[end:])
    return True
