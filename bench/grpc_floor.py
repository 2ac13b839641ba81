"""The floor under the gateway's per-token cost: what a grpc.aio server process spends per
streamed message when it does nothing else.

    .venv/bin/python -m bench.grpc_floor [--streams 128] [--messages 200] [--pace-ms 5]

A server process streams `--messages` one-token `GenerateResponse`s (a few characters of text,
as the gateway's chunks are) on each of `--streams` concurrent Generate calls, back to back, to
a client in this process; the server's CPU time (/proc/<pid>/stat) over the run, per message,
is the cost a gateway pays for each chunk it writes, before any work of its own. The
stack benchmark's gateway CPU per token is read against it (docs/benchmarks.md). Back to back
(the default) grpc may put several of a stream's messages in one write; `--pace-ms` spaces each
stream's messages as a worker's steps do (an asyncio sleep before each, whose timer is counted
too), so that each message is a write of its own, as in the stack bench.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.processes import Processes, cpu_seconds, free_port, wait_serving
from radixserve.serving import CHANNEL_OPTIONS, start_server
from radixserve.v1 import generation_pb2, generation_pb2_grpc

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


class Streamer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, pace_s: float) -> None:
        self.pace_s = pace_s

    async def Generate(self, request, context):
        for index in range(request.max_tokens):
            if self.pace_s:
                await asyncio.sleep(self.pace_s)
            yield generation_pb2.GenerateResponse(text=" word", token_ids=[1000 + index % 50])


async def serve(port: int, pace_s: float) -> None:
    streamer = Streamer(pace_s)
    server, health, _ = await start_server(
        "127.0.0.1", port, [lambda s: generation_pb2_grpc.add_GenerationServiceServicer_to_server(streamer, s)],
        [SERVICE_NAME])
    await health.set(True)
    await server.wait_for_termination()


async def run(args: argparse.Namespace) -> None:
    procs = Processes(Path(tempfile.mkdtemp(prefix="grpc-floor-")))
    port = free_port()
    server = procs.start("server", [sys.executable, "-m", "bench.grpc_floor", "--serve", str(port),
                                    "--pace-ms", str(args.pace_ms)])
    try:
        address = f"127.0.0.1:{port}"
        await wait_serving(address, server)
        num_channels = (args.streams + 63) // 64
        channels = [grpc.aio.insecure_channel(address, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1),
                                                                ("radixserve.bench_channel", i)])
                    for i in range(num_channels)]
        stubs = [generation_pb2_grpc.GenerationServiceStub(channel) for channel in channels]

        async def one(index: int) -> int:
            call = stubs[index % num_channels].Generate(generation_pb2.GenerateRequest(max_tokens=args.messages))
            return sum([1 async for _ in call])

        await asyncio.gather(*(one(i) for i in range(args.streams)))  # warm-up
        cpu, started = cpu_seconds(server.pid), time.monotonic()
        received = sum(await asyncio.gather(*(one(i) for i in range(args.streams))))
        cpu_s, wall_s = cpu_seconds(server.pid) - cpu, time.monotonic() - started
        for channel in channels:
            await channel.close()
        paced = f", one every {args.pace_ms:g} ms a stream" if args.pace_ms else ", back to back"
        print(f"grpc.aio server, {args.streams} streams x {args.messages} messages{paced}: {received} messages in "
              f"{wall_s:.2f} s, server CPU {1e6 * cpu_s / received:.1f} us per message "
              f"({received / wall_s:.0f} messages/s)")
    finally:
        procs.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--pace-ms", type=float, default=0.0,
                        help="space each stream's messages this far apart (0: back to back)")
    parser.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    asyncio.run(serve(args.serve, args.pace_ms / 1000) if args.serve else run(args))


if __name__ == "__main__":
    main()
