"""Two gateway processes on one gRPC and one HTTP port (what `radixserve up --gateways 2` starts,
see radixserve/stack_plan.py), in front of a fake router: the kernel spreads connections over
both and both serve; SIGTERM on one drains its streams to their end while the other keeps
serving the streams and connections it has and the new ones. A gateway starting beside serving
ones (a restart) takes no connection before it can serve it."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import httpx
import pytest

from gateway.background import BackgroundLoop
from gateway.fake_stream_router import StreamingFakeRouter
from gateway.harness import server_info
from procs import ServiceProcesses, free_port
from radixserve.v1 import generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.timeout(180)
NUM_CONNECTIONS = 12  # all on one gateway by chance: 2 / 2**12
NUM_TOKENS = 24
TOKEN_DELAY_S = 0.05
GRACE_S = 15.0
READY_TIMEOUT_S = 90.0
NAMES = ("gateway-a", "gateway-b")
JOINING = "gateway-c"


@dataclass
class Ports:
    grpc: int
    http: int
    router: str
    procs: ServiceProcesses
    start_gateway: Callable[[str], object]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc}"


@pytest.fixture(scope="module")
def gateways(smollm2_dir) -> Iterator[Ports]:
    loop = BackgroundLoop()
    router = StreamingFakeRouter(server_info())
    loop.run(router.start())
    router.script(list(range(300, 300 + NUM_TOKENS)), delay_s=TOKEN_DELAY_S)
    try:
        with ServiceProcesses() as procs:
            ports = Ports(free_port(), free_port(), router.address, procs, lambda name: procs.start(name, [
                sys.executable, "-m", "gateway_service", "--port", str(ports.grpc), "--http-port",
                str(ports.http), "--routers", router.address, "--model", str(smollm2_dir),
                "--metrics-port", "0", "--log-level", "INFO", "--shutdown-grace-s", str(GRACE_S),
                "--constraint-processes", "1"]))
            for name in NAMES:
                ports.start_gateway(name)
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not all("health: SERVING" in procs.tail(name, 100_000) for name in NAMES):
                procs.check_alive()
                assert time.monotonic() < deadline, "the gateways did not get ready"
                time.sleep(0.2)
            yield ports
    finally:
        loop.run(router.stop())
        loop.close()


def served_by(ports: Ports) -> dict[str, int]:
    """Requests each gateway logged (its access log line per request)."""
    return {name: ports.procs.tail(name, 1_000_000).count("radixserve.access: request ") for name in NAMES}


class Stream(threading.Thread):
    """One Generate on a connection of its own (a local subchannel pool: no sharing)."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.token_ids: list[int] = []
        self.code: grpc.StatusCode | None = None
        self.finish_reason = 0
        self.started_event = threading.Event()

    def run(self) -> None:
        options = [("grpc.use_local_subchannel_pool", 1)]
        request = generation_pb2.GenerateRequest(prompt="hello there", max_tokens=NUM_TOKENS, ignore_eos=True)
        try:
            with grpc.insecure_channel(self.address, options=options) as channel:
                for chunk in generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=60):
                    self.token_ids.extend(chunk.token_ids)
                    self.finish_reason = chunk.finish_reason or self.finish_reason
                    self.started_event.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code = exc.code()
        finally:
            self.started_event.set()


def run_streams(address: str, count: int) -> list[Stream]:
    streams = [Stream(address) for _ in range(count)]
    for stream in streams:
        stream.start()
    return streams


def complete(stream: Stream) -> tuple:
    stream.join(60)
    return (stream.code, stream.token_ids, stream.finish_reason)


FULL = (grpc.StatusCode.OK, list(range(300, 300 + NUM_TOKENS)), generation_pb2.FINISH_REASON_LENGTH)


def test_both_gateways_serve_grpc_and_http_on_the_shared_ports(gateways) -> None:
    before = served_by(gateways)
    streams = run_streams(gateways.address, NUM_CONNECTIONS)
    assert [complete(s) for s in streams] == [FULL] * NUM_CONNECTIONS
    for _ in range(4):  # a connection each (httpx's client per call)
        reply = httpx.post(f"http://127.0.0.1:{gateways.http}/v1/completions", timeout=30,
                           json={"model": "fake-smollm2", "prompt": "hi", "max_tokens": 3})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    after = served_by(gateways)
    assert sum(after.values()) - sum(before.values()) == NUM_CONNECTIONS + 4
    assert all(after[name] > before[name] for name in NAMES), after


def test_sigterm_on_one_drains_its_streams_and_the_other_keeps_serving(gateways) -> None:
    streams = run_streams(gateways.address, NUM_CONNECTIONS)
    assert all(s.started_event.wait(30) for s in streams)
    draining = gateways.procs.procs[NAMES[0]]
    draining.send_signal(signal.SIGTERM)
    sent_at = time.monotonic()
    # Every open stream ends in full, on the draining gateway too (the others never notice).
    assert [complete(s) for s in streams] == [FULL] * NUM_CONNECTIONS
    assert draining.wait(GRACE_S + 10) == 0
    assert time.monotonic() - sent_at < GRACE_S
    # New connections now all reach the other gateway.
    later = run_streams(gateways.address, 4)
    assert [complete(s) for s in later] == [FULL] * 4
    assert "stopping: draining in-flight streams" in gateways.procs.tail(NAMES[0], 1_000_000)
    assert gateways.procs.procs[NAMES[1]].poll() is None


def _one_call(ports: Ports, index: int) -> str | None:
    """A Tokenize over a new gRPC connection, or a completion over a new HTTP one (alternately):
    None when served, else what went wrong."""
    if index % 2:
        reply = httpx.post(f"http://127.0.0.1:{ports.http}/v1/completions", timeout=30,
                           json={"model": "fake-smollm2", "prompt": "hi", "max_tokens": 1})
        return None if reply.status_code == 200 else f"HTTP {reply.status_code}: {reply.text[:120]}"
    with grpc.insecure_channel(ports.address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        try:
            generation_pb2_grpc.GenerationServiceStub(channel).Tokenize(
                generation_pb2.TokenizeRequest(prompt="hello there"), timeout=30)
        except grpc.RpcError as exc:
            return f"gRPC {exc.code().name}: {exc.details()}"
    return None


def test_a_gateway_joining_the_ports_takes_no_connection_before_it_is_ready(gateways) -> None:
    """A gateway started beside a serving one (the launcher restarting one that died) listens on
    the shared ports only once it can serve: while it loads its tokenizer and starts its compile
    processes, every new connection is the serving one's. It used to listen at once, and the
    connections the kernel gave it meanwhile were refused ('still loading its tokenizer')."""
    assert any(proc.poll() is None for name, proc in gateways.procs.procs.items() if name in NAMES)
    gateways.start_gateway(JOINING)
    failures, calls, ready_at = [], 0, None
    deadline = time.monotonic() + READY_TIMEOUT_S
    while ready_at is None or time.monotonic() < ready_at + 1.0:
        assert gateways.procs.procs[JOINING].poll() is None, gateways.procs.tail(JOINING)
        assert time.monotonic() < deadline, "the joining gateway did not get ready"
        failure = _one_call(gateways, calls)
        calls += 1
        if failure is not None:
            failures.append(failure)
        if ready_at is None and "health: SERVING" in gateways.procs.tail(JOINING, 100_000):
            ready_at = time.monotonic()
    assert calls > 20, calls  # the joining gateway's start spanned many calls
    assert failures == [], f"{len(failures)} of {calls} calls failed while a gateway joined: {failures[:3]}"
    # Once ready, it takes its share.
    before = gateways.procs.tail(JOINING, 1_000_000).count("radixserve.access: request ")
    streams = run_streams(gateways.address, NUM_CONNECTIONS)
    assert [complete(s) for s in streams] == [FULL] * NUM_CONNECTIONS
    assert gateways.procs.tail(JOINING, 1_000_000).count("radixserve.access: request ") > before
