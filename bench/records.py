"""What one benchmark request leaves behind, and the figures computed from many of them."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    """Timings are seconds on one monotonic clock; `token_times_s` has one entry per token."""

    conversation: int
    turn: int
    start_s: float
    end_s: float = 0.0
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        data.pop("token_times_s")
        return data


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    """Throughput, latency percentiles and cache hit rate over one run."""
    done = [r for r in records if r.error is None]
    completion = sum(r.completion_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    ttft_ms = [1000 * (r.first_token_s - r.start_s) for r in done if r.first_token_s is not None]
    itl_ms = [
        1000 * (later - earlier)
        for r in done
        for earlier, later in zip(r.token_times_s, r.token_times_s[1:])
    ]
    return {
        "num_requests": len(records),
        "num_errors": len(records) - len(done),
        "wall_s": round(wall_s, 3),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "output_tokens_per_s": round(completion / wall_s, 2) if wall_s else None,
        "total_tokens_per_s": round((prompt + completion) / wall_s, 2) if wall_s else None,
        "ttft_p50_ms": _round(percentile(ttft_ms, 50)),
        "ttft_p99_ms": _round(percentile(ttft_ms, 99)),
        "itl_p50_ms": _round(percentile(itl_ms, 50)),
        "itl_p99_ms": _round(percentile(itl_ms, 99)),
        "itl_mean_ms": _round(statistics.fmean(itl_ms)) if itl_ms else None,
        "cache_hit_rate": round(cached / prompt, 4) if prompt else None,
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
