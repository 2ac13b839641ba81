"""Turn a benchmark run into `latest.json`, a Markdown table (`latest.md`) and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

# Goals from the benchmark issues, output tokens/s against each peer.
GOALS = {
    "shared_prefix": "≥ 1.5x vLLM CPU and faster than radixserve's own distinct; ≥ 8x transformers",
    "distinct": "≥ 1.0x vLLM CPU; ≥ 1.8x transformers",
    "single_stream": "≥ 1.0x vLLM CPU; ≥ 2.2x transformers",
    "multi_turn": "(no goal)",
}
# Peers in the order of the table; a run may lack one (vLLM when it cannot be installed).
PEERS = ("vllm", "transformers")
ENGINE_NAMES = {"radixserve": "radixserve", "vllm": "vLLM CPU", "transformers": "transformers"}


def _index(results: list[dict]) -> dict[tuple[str, int], dict]:
    return {(r["workload"], r["concurrency"]): r for r in results}


def _ratio(ours: float | None, theirs: float | None) -> str:
    if not ours or not theirs:
        return "n/a"
    return f"{ours / theirs:.2f}x"


def _cell(value) -> str:
    return "n/a" if value is None else str(value)


def _sampling_text(sampling: dict | None) -> str:
    if not sampling or sampling["temperature"] <= 0:
        return "greedy"
    return f"sampled at temperature {sampling['temperature']}, top_p {sampling['top_p']}"


def markdown(report: dict) -> str:
    ours = _index(report["radixserve"]["results"])
    peers = {name: _index(report[name]["results"]) for name in PEERS if report.get(name)}
    lines = [
        f"Measured {report['date']} on {report['machine']}; model `{report['model']}`, "
        f"{report['dtype']}, TP={report['tp']}, {_sampling_text(report.get('sampling'))}.",
        "",
        "| workload | conc. | engine | out tok/s | total tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
        "| cache hit | out vs vLLM | out vs transformers | TTFT p50 vs transformers |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, row in ours.items():
        vllm = peers.get("vllm", {}).get(key)
        hf = peers.get("transformers", {}).get(key)
        for engine, r in (("radixserve", row), ("vllm", vllm), ("transformers", hf)):
            if r is None:
                continue
            ratios = ["", "", ""]
            if engine == "radixserve":
                ratios = [_ratio(row["output_tokens_per_s"], vllm and vllm["output_tokens_per_s"]),
                          _ratio(row["output_tokens_per_s"], hf and hf["output_tokens_per_s"]),
                          _ratio(hf and hf["ttft_p50_ms"], row["ttft_p50_ms"])]
            hit = "" if r.get("cache_hit_rate") is None else f"{100 * r['cache_hit_rate']:.0f}%"
            lines.append(
                f"| {key[0]} | {key[1]} | {ENGINE_NAMES[engine]} | {r['output_tokens_per_s']} | {r['total_tokens_per_s']} "
                f"| {_cell(r['ttft_p50_ms'])} / {_cell(r['ttft_p99_ms'])} "
                f"| {_cell(r['itl_p50_ms'])} / {_cell(r['itl_p99_ms'])} | {hit} | {' | '.join(ratios)} |"
            )
    peaks = report["radixserve"].get("worker_peak_rss_mb") or []
    hf_peak = report["transformers"].get("peak_rss_mb") if report.get("transformers") else None
    lines += [
        "",
        f"Peak memory (VmHWM): radixserve workers {', '.join(f'{p} MiB' for p in peaks) or 'n/a'}; "
        f"transformers process {_cell(hf_peak)} MiB.",
        "Ratios: output tokens/s of radixserve over each peer; TTFT p50 of transformers over radixserve. "
        "vLLM runs offline (`LLM.generate`, one call per batch), so its TTFT and ITL are not observed.",
        "Goals: " + "; ".join(f"{k}: {v}" for k, v in GOALS.items()) + ".",
    ]
    if "vllm" not in peers and report.get("vllm_skipped"):
        lines.append(f"vLLM CPU did not run: {report['vllm_skipped']}")
    lines += http_vs_grpc(report)
    lines += speculation(report)
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


SPECULATION_GOALS = "quote_edit ≥ 2.0x in bfloat16; every other workload ≥ 0.97x"


def speculation(report: dict) -> list[str]:
    """Speculative decoding on vs off (bench.bench_speculation); empty when it was not run."""
    spec = report.get("speculation")
    if not spec:
        return []
    lines = [
        "",
        f"Speculative decoding on vs off: two stacks side by side, each workload alternating between "
        f"them for {spec['repeats']} rounds (medians), {spec['dtype']}:",
        "",
        "| workload | conc. | out tok/s on / off | on vs off | acceptance | tokens per verifying step |",
        "|---|---|---|---|---|---|",
    ]
    for r in spec["results"]:
        lines.append(
            f"| {r['workload']} | {r['concurrency']} | {r['on_tokens_per_s']} / {r['off_tokens_per_s']} "
            f"| {_cell(r['ratio'])}x | {_cell(r['acceptance_rate'])} | {_cell(r['tokens_per_verify_step'])} |"
        )
    lines += ["", f"Goals: {SPECULATION_GOALS}."]
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
            for engine, style in (("radixserve", "o-"), ("vllm", "^-."), ("transformers", "s--")):
                if not report.get(engine):
                    continue
                points = sorted((r["concurrency"], r[figure]) for r in report[engine]["results"]
                                if r["workload"] == workload and r[figure] is not None)
                if points:
                    ax.plot(*zip(*points), style, label=ENGINE_NAMES[engine])
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


# The results table's place in docs/benchmarks.md, which `make bench` rewrites.
TABLE_START = "<!-- BENCH:START -->"
TABLE_END = "<!-- BENCH:END -->"


def write_report(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "latest.json").write_text(json.dumps(report, indent=2))
    (out_dir / "latest.md").write_text(markdown(report))
    plot(report, out_dir)


def update_docs(page: Path, table: str) -> bool:
    """Put `table` between the page's benchmark markers; False when the markers are missing."""
    text = page.read_text()
    start, end = text.find(TABLE_START), text.find(TABLE_END)
    if start < 0 or end < start:
        return False
    page.write_text(text[: start + len(TABLE_START)] + "\n" + table + text[end:])
    return True
