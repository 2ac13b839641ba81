"""One drain for both APIs (issue 34): SIGTERM on a real gateway process with long gRPC and
HTTP streams in flight, and a short one of each. The short ones complete; the long ones end
before --shutdown-grace-s with their API's error (gRPC UNAVAILABLE; HTTP an error event, then
`data: [DONE]`, on a cleanly ended response); the process exits within the grace."""

from __future__ import annotations

import json
import signal
import threading
import time

import grpc
import httpx
import pytest

from gateway.gateway_process import gateway_process
from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc

pytestmark = pytest.mark.timeout(180)
MODEL = "fake-smollm2"
GRACE_S = 4.0
TOKEN_DELAY_S = 0.05
LONG_TOKENS = 400  # 20 s at the fake router's pace: far past the grace
SHORT_TOKENS = 30  # 1.5 s: done within the grace, though started before the SIGTERM
NUM_LONG = 2
CALL_TIMEOUT_S = 120.0


def grpc_stream(address: str, max_tokens: int, outcome: dict) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        outcome["tokens"] = 0
        try:
            for response in stub.Generate(pb.GenerateRequest(prompt="count", max_tokens=max_tokens,
                                                             ignore_eos=True), timeout=CALL_TIMEOUT_S):
                outcome["tokens"] += len(response.token_ids)
                outcome["started"].set()
                outcome["finish"] = response.finish_reason
            outcome["status"] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            outcome["status"] = exc.code()
        outcome["ended"] = time.monotonic()
        outcome["started"].set()  # a call that failed at once must not hold the test up


def http_stream(url: str, max_tokens: int, outcome: dict) -> None:
    outcome["events"] = []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=CALL_TIMEOUT_S,
                      json={"model": MODEL, "prompt": "count", "max_tokens": max_tokens, "stream": True,
                            "ignore_eos": True}) as reply:
        outcome["status"] = reply.status_code
        for line in reply.iter_lines():  # a connection cut mid-chunk would raise here
            if line.startswith("data: "):
                outcome["events"].append(line[len("data: "):])
                outcome["started"].set()
    outcome["ended"] = time.monotonic()
    outcome["started"].set()


def test_sigterm_ends_every_stream_within_the_grace(smollm2_dir) -> None:
    with gateway_process(smollm2_dir, "--shutdown-grace-s", str(GRACE_S)) as gateway:
        gateway.router.script(list(range(1000, 1000 + LONG_TOKENS)), delay_s=TOKEN_DELAY_S)
        # The first calls teach the gateway that the fake router has no multiplexed Stream (the
        # calls in flight while it learns that fail): learn it before the streams under test.
        for _ in range(2):
            grpc_stream(gateway.grpc_address, 1, {"started": threading.Event()})
        plan = [(grpc_stream, gateway.grpc_address, LONG_TOKENS)] * NUM_LONG + \
               [(http_stream, gateway.http_url, LONG_TOKENS)] * NUM_LONG + \
               [(grpc_stream, gateway.grpc_address, SHORT_TOKENS), (http_stream, gateway.http_url, SHORT_TOKENS)]
        outcomes = [{"started": threading.Event()} for _ in plan]
        threads = [threading.Thread(target=run, args=(where, tokens, outcome))
                   for (run, where, tokens), outcome in zip(plan, outcomes)]
        for thread in threads:
            thread.start()
        for outcome in outcomes:  # every stream has its first token before SIGTERM
            assert outcome["started"].wait(CALL_TIMEOUT_S), (outcomes, gateway.log()[-3000:])
        proc = gateway.procs.procs["gateway"]
        sigterm_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=GRACE_S * 4)
        exited_s = time.monotonic() - sigterm_at
        for thread in threads:
            thread.join(timeout=CALL_TIMEOUT_S)
        log = gateway.log()
    ended = [round(o["ended"] - sigterm_at, 2) for o in outcomes]
    print(f"exited {exited_s:.2f} s after SIGTERM (grace {GRACE_S} s); streams ended at {ended}")
    assert proc.returncode == 0, log
    assert exited_s < GRACE_S, log
    long_grpc, long_http = outcomes[:NUM_LONG], outcomes[NUM_LONG:2 * NUM_LONG]
    short_grpc, short_http = outcomes[2 * NUM_LONG:]
    for outcome in outcomes:
        assert outcome["ended"] - sigterm_at < GRACE_S
    for outcome in long_grpc:
        assert outcome["status"] == grpc.StatusCode.UNAVAILABLE and outcome["tokens"] > 0
    for outcome in long_http:
        assert outcome["status"] == 200
        events = outcome["events"]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable" and "shut down" in error["message"]
        assert len(events) > 3  # tokens came before the error
    assert short_grpc["status"] == grpc.StatusCode.OK and short_grpc["tokens"] == SHORT_TOKENS
    assert short_http["events"][-1] == "[DONE]"
    assert json.loads(short_http["events"][-2])["choices"][0]["finish_reason"] == "length"
