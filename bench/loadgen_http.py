"""The same closed-loop load through the OpenAI-compatible HTTP API (`/v1/chat/completions`).

Requests match the gRPC load generator's (greedy, `ignore_eos`, the same messages and
max_tokens) and stream with `stream_options.include_usage`, so both APIs report the same
records. The client is httpx with one connection per concurrent stream and SSE parsed by hand,
so what the figures add over gRPC is the server's HTTP layer, not an SDK's.
"""

from __future__ import annotations

import json
import time

import httpx

from bench.loadgen import run_closed_loop
from bench.records import RequestRecord
from bench.workloads import Workload

DATA = "data: "


async def run_workload_http(
    base_url: str,
    model: str,
    workload: Workload,
    concurrency: int,
    time_limit_s: float,
    request_timeout_s: float = 600.0,
) -> tuple[list[RequestRecord], float]:
    """Run `workload` at `concurrency` against `base_url` (e.g. http://127.0.0.1:8000/v1)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=request_timeout_s, limits=limits) as client:

        async def send(messages: list[dict[str, str]], max_tokens: int, record: RequestRecord) -> str:
            body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                    "temperature": workload.temperature, "top_p": workload.top_p,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            pieces: list[str] = []
            try:
                async with client.stream("POST", "/chat/completions", json=body) as reply:
                    if reply.status_code != 200:
                        record.error = f"HTTP {reply.status_code}: {(await reply.aread()).decode()[:200]}"
                        record.end_s = time.monotonic()
                        return ""
                    async for line in reply.aiter_lines():
                        if not line.startswith(DATA) or line == DATA + "[DONE]":
                            continue
                        _record_event(json.loads(line[len(DATA):]), record, pieces)
            except httpx.HTTPError as exc:
                record.error = f"{type(exc).__name__}: {exc}"
            record.end_s = time.monotonic()
            return "".join(pieces)

        return await run_closed_loop(send, workload, concurrency, time_limit_s)


def _record_event(event: dict, record: RequestRecord, pieces: list[str]) -> None:
    now = time.monotonic()
    if "error" in event:
        record.error = event["error"].get("message", "error event")
        return
    for choice in event.get("choices", []):
        text = choice["delta"].get("content") or ""
        if text:
            # One token per content event (the gateway sends one chunk per router response;
            # exact counts come from usage).
            if record.first_token_s is None:
                record.first_token_s = now
            record.token_times_s.append(now)
            pieces.append(text)
    usage = event.get("usage")
    if usage:
        record.prompt_tokens = usage["prompt_tokens"]
        record.completion_tokens = usage["completion_tokens"]
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
