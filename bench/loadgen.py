"""Closed-loop load generator; `run_workload` drives the public gRPC API (`loadgen_http`: HTTP).

`concurrency` tasks each take the next conversation from a shared queue and run its turns one
after another (a turn is sent when the previous turn's reply is complete, and carries it). The
run stops taking new conversations when `time_limit_s` has passed; requests in flight finish.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Awaitable, Callable

import grpc

from bench.records import RequestRecord
from bench.workloads import Workload, build_messages
from radixserve.health import check_health
from radixserve.serving import CHANNEL_OPTIONS
from radixserve.v1 import generation_pb2, generation_pb2_grpc


async def _one_request(
    stub: generation_pb2_grpc.GenerationServiceStub,
    messages: list[dict[str, str]],
    max_tokens: int,
    record: RequestRecord,
    timeout_s: float,
    workload: Workload,
) -> str:
    request = generation_pb2.GenerateRequest(
        messages=[generation_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        max_tokens=max_tokens,
        ignore_eos=True,
        sampling=generation_pb2.SamplingParams(temperature=workload.temperature, top_p=workload.top_p),
    )
    pieces: list[str] = []
    try:
        async for chunk in stub.Generate(request, timeout=timeout_s):
            now = time.monotonic()
            if chunk.token_ids and record.first_token_s is None:
                record.first_token_s = now
            record.token_times_s.extend([now] * len(chunk.token_ids))
            pieces.append(chunk.text)
            if chunk.HasField("usage"):
                record.prompt_tokens = chunk.usage.prompt_tokens
                record.completion_tokens = chunk.usage.completion_tokens
                record.cached_tokens = chunk.usage.cached_tokens
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    record.end_s = time.monotonic()
    return "".join(pieces)


# Sends one request: (messages, max_tokens, record) -> the reply's text; fills `record` in.
SendOne = Callable[[list[dict[str, str]], int, RequestRecord], Awaitable[str]]


async def run_closed_loop(
    send: SendOne, workload: Workload, concurrency: int, time_limit_s: float
) -> tuple[list[RequestRecord], float]:
    """Run `workload` at `concurrency` through `send`; returns the records and the wall time."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(workload.conversations)):
        queue.put_nowait(index)
    records: list[RequestRecord] = []
    started = time.monotonic()
    deadline = started + time_limit_s

    async def client_loop() -> None:
        while time.monotonic() < deadline:
            try:
                conversation = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            history: list[tuple[str, str]] = []
            for turn, user in enumerate(workload.conversations[conversation]):
                messages = build_messages(workload.system_prompt, history, user)
                record = RequestRecord(conversation, turn, start_s=time.monotonic())
                records.append(record)
                reply = await send(messages, workload.max_tokens, record)
                if record.error:
                    break
                history.append((user, reply))

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return records, time.monotonic() - started


async def run_workload(
    address: str,
    workload: Workload,
    concurrency: int,
    time_limit_s: float,
    request_timeout_s: float = 600.0,
) -> tuple[list[RequestRecord], float]:
    """Run `workload` at `concurrency` through the gRPC API at `address`."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        async def send(messages: list[dict[str, str]], max_tokens: int, record: RequestRecord) -> str:
            return await _one_request(stub, messages, max_tokens, record, request_timeout_s, workload)

        return await run_closed_loop(send, workload, concurrency, time_limit_s)


async def wait_serving(address: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Wait until the stack `proc` started serves at `address`; exit when it dies or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"[bench] the stack exited with {proc.returncode} before it was ready")
        if await check_health(address, timeout_s=1.0):
            return
        await asyncio.sleep(0.5)
    raise SystemExit(f"[bench] {address} not serving after {timeout_s}s")
