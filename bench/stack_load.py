"""The stack benchmark's load generator: its own process, so that its CPU is not the gateway's.

    python -m bench.stack_load --api grpc|grpc-many|client-mux|client-[mux-]threads|http --target ADDR --streams N --max-tokens T \
        --window START END --out FILE

`--streams` closed-loop streams each send completion requests (a short plain prompt,
`ignore_eos`, greedy) one after another until the window's END (monotonic clock, shared with
the bench process); the requests still running then finish (only the window is counted). Over gRPC the requests spread over one channel per `STREAMS_PER_CHANNEL`
(or `--connections` channels where more)
(the gateway allows a bounded number of calls per connection); `grpc-many` puts all the streams'
requests on one GenerateMany call (each message carries every request's new tokens, so a
message's tokens count as arriving together, each request's gap its own); `client-mux` runs each
stream's requests through the Python client's `AsyncClient(multiplex=True).stream` (its shared
GenerateMany calls, radixserve_client/shared_call.py), as a user's code would, and
`client-mux-threads` the same with a thread per stream on one blocking `Client(multiplex=True)`
(`client-threads`: a Generate call per request from the same threads);
over HTTP each stream has its
own connection, written and parsed by hand (chunked SSE lines), so the client costs little.
Written to FILE as JSON: tokens that arrived inside [START, END), the gaps between consecutive
tokens of a request in the window (ms; a message that carries several tokens gives its first
token the gap and the others none), and the number of errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from radixserve.serving import CHANNEL_OPTIONS
from radixserve_client import AsyncClient, Client, RadixServeError
from radixserve.v1 import generation_pb2, generation_pb2_grpc

STREAMS_PER_CHANNEL = 64
PROMPT = "Write a long story about a radix tree that learned to cache prompts, number {}:"
DATA = b"data: "


@dataclass
class Tally:
    window: tuple[float, float]
    tokens: int = 0
    gaps_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def arrived(self, now: float, num_tokens: int, previous: float | None) -> None:
        if not (self.window[0] <= now < self.window[1]) or num_tokens == 0:
            return
        self.tokens += num_tokens
        if previous is not None:
            self.gaps_ms.append(1000 * (now - previous))
            self.gaps_ms.extend([0.0] * (num_tokens - 1))
        else:
            self.gaps_ms.extend([0.0] * (num_tokens - 1))

    def events(self, times: list[float], num_tokens: int) -> None:
        """One HTTP request's SSE event times and its token count (from usage): SSE text does
        not say how many tokens an event carries, so each event counts `num_tokens / events`
        tokens, and the tokens beyond one per event add gaps of 0."""
        if not times:
            return
        per_event = num_tokens / len(times)
        in_window = [t for t in times if self.window[0] <= t < self.window[1]]
        self.tokens += round(per_event * len(in_window))
        gaps = [1000 * (b - a) for a, b in zip(times, times[1:]) if self.window[0] <= b < self.window[1]]
        self.gaps_ms.extend(gaps)
        self.gaps_ms.extend([0.0] * max(0, round((per_event - 1) * len(gaps))))


async def grpc_stream(stub: generation_pb2_grpc.GenerationServiceStub, index: int, max_tokens: int,
                      tally: Tally) -> None:
    count = 0
    while time.monotonic() < tally.window[1]:
        request = generation_pb2.GenerateRequest(
            prompt=PROMPT.format(index * 1000 + count), max_tokens=max_tokens, ignore_eos=True,
            sampling=generation_pb2.SamplingParams(temperature=0.0))
        count += 1
        previous = None
        call = stub.Generate(request, timeout=600)
        try:
            async for chunk in call:
                now = time.monotonic()
                tally.arrived(now, len(chunk.token_ids), previous)
                if chunk.token_ids:
                    previous = now
        except grpc.aio.AioRpcError as exc:
            tally.errors.append(f"{exc.code().name}: {exc.details()}")
            return


async def run_grpc(target: str, streams: int, max_tokens: int, tally: Tally, connections: int = 0) -> None:
    num_channels = max(connections, (streams + STREAMS_PER_CHANNEL - 1) // STREAMS_PER_CHANNEL)
    # A local subchannel pool and arguments of its own: each channel opens its own connection.
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(target, options=[*options, ("radixserve.bench_channel", i)])
                for i in range(num_channels)]
    try:
        stubs = [generation_pb2_grpc.GenerationServiceStub(channel) for channel in channels]
        await asyncio.gather(*(grpc_stream(stubs[i % num_channels], i, max_tokens, tally) for i in range(streams)))
    finally:
        for channel in channels:
            await channel.close()


async def run_grpc_many(target: str, streams: int, max_tokens: int, tally: Tally) -> None:
    """Every stream's requests on one GenerateMany call: a stream starts its next request (a new
    id) when the last update of its previous one arrives."""
    outgoing: asyncio.Queue[generation_pb2.ManyRequest | None] = asyncio.Queue()
    counts = [0] * streams
    previous: dict[int, float | None] = {}

    def start(stream: int) -> None:
        request_id = stream * 1_000_000 + counts[stream]
        request = generation_pb2.GenerateRequest(
            prompt=PROMPT.format(request_id), max_tokens=max_tokens, ignore_eos=True,
            sampling=generation_pb2.SamplingParams(temperature=0.0))
        counts[stream] += 1
        previous[request_id] = None
        outgoing.put_nowait(generation_pb2.ManyRequest(id=request_id, generate=request))

    async def requests():
        while (message := await outgoing.get()) is not None:
            yield message

    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        call = generation_pb2_grpc.GenerationServiceStub(channel).GenerateMany(requests(), timeout=600)
        for stream in range(streams):
            start(stream)
        open_requests = streams
        try:
            async for message in call:
                now = time.monotonic()
                for update in message.updates:
                    request_id = update.id
                    num_tokens = len(update.response.token_ids)
                    tally.arrived(now, num_tokens, previous[request_id])
                    if num_tokens:
                        previous[request_id] = now
                    if update.code:
                        tally.errors.append(f"{update.code}: {update.message}")
                    if update.code or update.response.finish_reason:
                        del previous[request_id]
                        if now < tally.window[1] and not update.code:
                            start(request_id // 1_000_000)
                        else:
                            open_requests -= 1
                if open_requests == 0:
                    outgoing.put_nowait(None)
        except grpc.aio.AioRpcError as exc:
            tally.errors.append(f"{exc.code().name}: {exc.details()}")


async def run_client_mux(target: str, streams: int, max_tokens: int, tally: Tally) -> None:
    """Every stream a loop of `stream` calls on one multiplexing AsyncClient."""
    async with AsyncClient(target, multiplex=True) as client:

        async def stream_loop(index: int) -> None:
            count = 0
            while time.monotonic() < tally.window[1]:
                previous = None
                try:
                    async for chunk in client.stream(prompt=PROMPT.format(index * 1000 + count), max_tokens=max_tokens,
                                                     ignore_eos=True, temperature=0.0, timeout=600):
                        now = time.monotonic()
                        tally.arrived(now, len(chunk.token_ids), previous)
                        if chunk.token_ids:
                            previous = now
                except RadixServeError as exc:
                    tally.errors.append(str(exc))
                    return
                count += 1

        await asyncio.gather(*(stream_loop(index) for index in range(streams)))


def run_client_threads(target: str, streams: int, max_tokens: int, tally: Tally, multiplex: bool) -> None:
    """Every stream a thread looping `stream` calls on one blocking Client."""
    lock = threading.Lock()  # over the tally

    def stream_loop(index: int) -> None:
        count = 0
        while time.monotonic() < tally.window[1]:
            previous = None
            try:
                for chunk in client.stream(prompt=PROMPT.format(index * 1000 + count), max_tokens=max_tokens,
                                           ignore_eos=True, temperature=0.0, timeout=600):
                    now = time.monotonic()
                    with lock:
                        tally.arrived(now, len(chunk.token_ids), previous)
                    if chunk.token_ids:
                        previous = now
            except RadixServeError as exc:
                with lock:
                    tally.errors.append(str(exc))
                return
            count += 1

    with Client(target, multiplex=multiplex) as client, ThreadPoolExecutor(max_workers=streams) as pool:
        list(pool.map(stream_loop, range(streams)))


async def http_stream(host: str, port: int, model: str, index: int, max_tokens: int, tally: Tally) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    count = 0
    try:
        while time.monotonic() < tally.window[1]:
            body = json.dumps({"model": model, "prompt": PROMPT.format(index * 1000 + count),
                               "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                               "stream": True, "stream_options": {"include_usage": True}}).encode()
            count += 1
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            status = await reader.readline()
            if b" 200 " not in status:
                tally.errors.append(status.decode(errors="replace").strip())
                return
            times: list[float] = []
            num_tokens = 0
            while True:
                line = await reader.readline()
                if not line:
                    tally.errors.append("the gateway closed the connection")
                    return
                if not line.startswith(DATA):
                    continue  # headers, chunk sizes, blank lines
                if line.startswith(b"data: [DONE]"):
                    for _ in range(4):  # the event's blank line, the chunk's CRLF, the last chunk
                        await reader.readline()
                    break
                event = json.loads(line[len(DATA):])
                if "error" in event:
                    tally.errors.append(str(event["error"])[:200])
                    return
                if event["choices"]:
                    times.append(time.monotonic())
                elif event.get("usage"):
                    num_tokens = event["usage"]["completion_tokens"]
            tally.events(times, num_tokens)
    finally:
        writer.close()


def served_model(host: str, port: int) -> str:
    """The first model id the gateway's `/v1/models` lists (a real worker serves its folder's name)."""
    with urllib.request.urlopen(f"http://{host}:{port}/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


async def run_http(target: str, model: str, streams: int, max_tokens: int, tally: Tally) -> None:
    host, port = target.rsplit(":", 1)
    model = model or served_model(host, int(port))
    await asyncio.gather(*(http_stream(host, int(port), model, i, max_tokens, tally) for i in range(streams)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--api", required=True, choices=(
        "grpc", "grpc-many", "client-mux", "client-threads", "client-mux-threads", "http"))
    parser.add_argument("--target", required=True, help="gRPC address, or host:port of the HTTP API")
    parser.add_argument("--model", default="", help="the HTTP requests' model (default: what /v1/models lists first)")
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--window", type=float, nargs=2, required=True)
    parser.add_argument("--connections", type=int, default=0,
                        help="grpc: at least this many connections (the kernel spreads connections, not calls, "
                             "over gateways sharing a port)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tally = Tally(tuple(args.window))
    run = None
    if args.api in ("client-threads", "client-mux-threads"):
        run_client_threads(args.target, args.streams, args.max_tokens, tally, args.api == "client-mux-threads")
    elif args.api == "grpc":
        run = run_grpc(args.target, args.streams, args.max_tokens, tally, args.connections)
    elif args.api == "grpc-many":
        run = run_grpc_many(args.target, args.streams, args.max_tokens, tally)
    elif args.api == "client-mux":
        run = run_client_mux(args.target, args.streams, args.max_tokens, tally)
    else:
        run = run_http(args.target, args.model, args.streams, args.max_tokens, tally)
    if run is not None:
        asyncio.run(run)
    with open(args.out, "w") as out:
        json.dump({"tokens": tally.tokens, "gaps_ms": tally.gaps_ms, "errors": tally.errors[:5],
                   "num_errors": len(tally.errors)}, out)


if __name__ == "__main__":
    main()
