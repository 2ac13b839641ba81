"""What the HTTP layer costs over gRPC, paired: the same greedy request alternately through
both APIs, one at a time, so both see the same cache state (the prompt is cached after the
warm-up) and the same machine load. Prints TTFT and ITL medians of each API and their ratio.

    python -m bench.http_overhead --address 127.0.0.1:50051 --http http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from bench.loadgen import run_workload
from bench.loadgen_http import run_workload_http
from bench.records import RequestRecord
from bench.workloads import Workload

PROMPT = "Explain in one paragraph what a radix tree is and why a cache would use one."


def _gaps_ms(record: RequestRecord) -> list[float]:
    times = record.token_times_s
    return [1000 * (later - earlier) for earlier, later in zip(times, times[1:])]


async def paired(address: str, base_url: str, model: str, num_pairs: int, max_tokens: int) -> dict:
    """Medians over `num_pairs` alternating requests (gRPC first in even pairs, HTTP in odd)."""
    workload = Workload("paired", "one greedy request", None, [[PROMPT]], max_tokens)

    async def grpc_once() -> RequestRecord:
        records, _ = await run_workload(address, workload, 1, time_limit_s=600)
        return records[0]

    async def http_once() -> RequestRecord:
        records, _ = await run_workload_http(base_url, model, workload, 1, time_limit_s=600)
        return records[0]

    await grpc_once()  # warm-up: the prompt enters the cache, both APIs then hit it alike
    await http_once()
    ttft: dict[str, list[float]] = {"grpc": [], "http": []}
    itl: dict[str, list[float]] = {"grpc": [], "http": []}
    for index in range(num_pairs):
        order = [("grpc", grpc_once), ("http", http_once)]
        for api, once in order if index % 2 == 0 else reversed(order):
            record = await once()
            if record.error or record.first_token_s is None:
                raise SystemExit(f"[bench] {api} request failed: {record.error}")
            ttft[api].append(1000 * (record.first_token_s - record.start_s))
            itl[api].extend(_gaps_ms(record))
    result = {"num_pairs": num_pairs, "max_tokens": max_tokens}
    for name, values in (("ttft", ttft), ("itl", itl)):
        grpc_ms, http_ms = statistics.median(values["grpc"]), statistics.median(values["http"])
        result[f"{name}_p50_ms"] = {"grpc": round(grpc_ms, 2), "http": round(http_ms, 2),
                                    "ratio": round(http_ms / grpc_ms, 3)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:50051", help="gateway gRPC address")
    parser.add_argument("--http", default="http://127.0.0.1:8000/v1", help="HTTP API base URL")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="served model id")
    parser.add_argument("--pairs", type=int, default=20, help="request pairs")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    args = parser.parse_args()
    result = asyncio.run(paired(args.address, args.http, args.model, args.pairs, args.max_tokens))
    for name in ("ttft_p50_ms", "itl_p50_ms"):
        r = result[name]
        print(f"{name}: gRPC {r['grpc']} ms, HTTP {r['http']} ms, HTTP/gRPC {r['ratio']}x")


if __name__ == "__main__":
    main()
