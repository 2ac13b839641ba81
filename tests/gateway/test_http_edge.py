"""The HTTP edge of a real gateway process under hostile connections (issue 36):

- sixteen concurrent unauthenticated 50 MB bodies are each answered 401 from the headers alone,
  the server drops at most --max-request-bytes of each and closes it (sending all of it fails),
  the gateway's RSS grows < 100 MB and an authenticated stream running meanwhile keeps its pace
  (gaps < 0.5 s); an unauthenticated body within --max-request-bytes, sent whole before the
  client reads, still gets its 401;
- connections that never finish their request head, idle new connections and idle keep-alive
  connections are closed within their timeouts (short here), and so is a gRPC connection that
  never starts its handshake; a stream longer than all those timeouts is unaffected;
- a body that stalls or dribbles (declared length or chunked) is 408 within its timeout and its
  connection closed; a client that leaves in the middle of its body is logged as cancelled, not
  as an internal error;
- with `--log-format json` the access log line of that stream is one JSON object carrying the
  caller's X-Request-Id, its route, status and token counts.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from gateway.gateway_process import GatewayProcess, gateway_process, rss_mb

pytestmark = pytest.mark.timeout(240)
MODEL = "fake-smollm2"
TOKEN = "edge-token-0123456789"
NUM_BODIES = 16
BODY_BYTES = 50 << 20
SEND_PIECE = 1 << 16
MAX_RSS_GROWTH_MB = 100
MAX_TOKEN_GAP_S = 0.5
STREAM_TOKENS = 150
TOKEN_DELAY_S = 0.02
HEAD_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
KEEP_ALIVE_S = 1.0
# A closed connection is noticed by a blocking read with this much slack over its timeout.
CLOSE_SLACK_S = 1.5
CALL_TIMEOUT_S = 30.0
MAX_REQUEST_BYTES = 4 << 20  # the gateway's default --max-request-bytes
# What the client's send buffer and the server's receive buffer hold on loopback, beyond what the
# gateway read: Linux's largest autotuned buffers are 4 and 6 MiB.
SOCKET_BUFFERS_BYTES = 12 << 20


@pytest.fixture(scope="module")
def gateway(smollm2_dir):
    with gateway_process(smollm2_dir, "--api-tokens", TOKEN, "--http-header-timeout-s", str(HEAD_TIMEOUT_S),
                         "--http-keep-alive-s", str(KEEP_ALIVE_S), "--http-body-timeout-s", str(BODY_TIMEOUT_S),
                         "--log-format", "json") as running:
        yield running


def stream_gaps(gateway: GatewayProcess, request_id: str = "") -> list[float]:
    """Arrival gaps of an authenticated completion stream's events."""
    arrivals = []
    headers = {"Authorization": f"Bearer {TOKEN}", **({"X-Request-Id": request_id} if request_id else {})}
    with httpx.stream("POST", f"{gateway.http_url}/v1/completions", headers=headers, timeout=CALL_TIMEOUT_S,
                      json={"model": MODEL, "prompt": "count", "max_tokens": STREAM_TOKENS, "stream": True,
                            "ignore_eos": True}) as reply:
        assert reply.status_code == 200
        if request_id:
            assert reply.headers["x-request-id"] == request_id
        for line in reply.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
                last = line
    assert last == "data: [DONE]"
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def unauthenticated_body(port: int) -> tuple[int, int]:
    """(HTTP status answered, body bytes the client managed to send before the server closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT_S) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % BODY_BYTES)
        sock.sendall(b"{" + b" " * (SEND_PIECE - 1))
        status = int(sock.recv(4096).split(b" ", 2)[1])
        sent = SEND_PIECE
        try:
            while sent < BODY_BYTES:
                sock.sendall(b" " * SEND_PIECE)
                sent += SEND_PIECE
        except OSError:  # the server closed: the rest is never read
            pass
        return status, sent


def warm_up(gateway: GatewayProcess) -> None:
    """One stream before anything is measured (the gateway's first request to the fake router
    finds it has no Stream call and falls back to Generate)."""
    stream_gaps(gateway)


def test_unauthenticated_bodies_are_refused_unread(gateway) -> None:
    gateway.router.script(list(range(1000, 1000 + STREAM_TOKENS)), delay_s=TOKEN_DELAY_S)
    warm_up(gateway)
    rss_before = rss_mb(gateway.pid)
    results: list[tuple[int, int]] = []
    gaps: list[float] = []
    streamer = threading.Thread(target=lambda: gaps.extend(stream_gaps(gateway)))
    streamer.start()
    senders = [threading.Thread(target=lambda: results.append(unauthenticated_body(gateway.http_port)))
               for _ in range(NUM_BODIES)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join(timeout=CALL_TIMEOUT_S * 2)
    streamer.join(timeout=CALL_TIMEOUT_S * 2)
    growth = rss_mb(gateway.pid) - rss_before
    print("statuses:", [s for s, _ in results], "most bytes sent before the close:",
          max(sent for _, sent in results), f"RSS growth {growth:.1f} MB, max gap {max(gaps):.3f} s")
    assert len(results) == NUM_BODIES and all(status == 401 for status, _ in results)
    assert all(sent < MAX_REQUEST_BYTES + SOCKET_BUFFERS_BYTES for _, sent in results)
    assert growth < MAX_RSS_GROWTH_MB
    assert max(gaps) < MAX_TOKEN_GAP_S


def test_an_unauthenticated_body_within_the_limit_sent_whole_gets_its_401(gateway) -> None:
    """The rest of a body answered unread is read and dropped up to --max-request-bytes, so a
    client that sends all of it before reading (as most do) reads the answer, not a reset."""
    body = b"{" + b" " * (MAX_REQUEST_BYTES - 1024) + b"}"
    for _ in range(3):
        reply = httpx.post(f"{gateway.http_url}/v1/chat/completions", content=body,
                           headers={"Content-Type": "application/json"}, timeout=CALL_TIMEOUT_S)
        assert reply.status_code == 401, reply.text


def test_large_authenticated_bodies_are_parsed_off_the_event_loop(gateway) -> None:
    """Bodies just under --max-request-bytes (4 MiB) are read, parsed and validated (their
    prompt is then over --max-prompt-chars: 400) while a stream keeps its pace."""
    gateway.router.script(list(range(1000, 1000 + STREAM_TOKENS)), delay_s=TOKEN_DELAY_S)
    body = json.dumps({"model": MODEL, "prompt": "word " * 800_000}).encode()
    assert len(body) < 4 << 20
    statuses: list[int] = []
    gaps: list[float] = []
    streamer = threading.Thread(target=lambda: gaps.extend(stream_gaps(gateway)))
    streamer.start()
    time.sleep(0.3)

    def send() -> None:
        for _ in range(3):
            statuses.append(httpx.post(f"{gateway.http_url}/v1/completions", content=body, timeout=CALL_TIMEOUT_S,
                                       headers={"Authorization": f"Bearer {TOKEN}",
                                                "Content-Type": "application/json"}).status_code)

    senders = [threading.Thread(target=send) for _ in range(4)]
    for thread in senders:
        thread.start()
    for thread in [*senders, streamer]:
        thread.join(timeout=CALL_TIMEOUT_S * 2)
    print(f"large bodies: {statuses}, stream max gap {max(gaps):.3f} s")
    assert statuses == [400] * 12
    assert max(gaps) < MAX_TOKEN_GAP_S


def seconds_until_closed(sock: socket.socket, dribble: bytes = b"") -> float:
    """Time until the server closes `sock`, sending `dribble` a byte at a time meanwhile."""
    start = time.monotonic()
    sock.settimeout(0.2)
    sent = 0
    while time.monotonic() - start < CALL_TIMEOUT_S:
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - start
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - start
        if sent < len(dribble):
            try:
                sock.send(dribble[sent:sent + 1])
            except OSError:
                return time.monotonic() - start
            sent += 1
    return float("inf")


def test_slow_and_idle_connections_are_closed_and_streams_unaffected(gateway) -> None:
    gateway.router.script(list(range(1000, 1000 + STREAM_TOKENS)), delay_s=TOKEN_DELAY_S)
    closed: dict[str, float] = {}
    gaps: list[float] = []

    def measure(name: str, port: int, first: bytes = b"", dribble: bytes = b"") -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT_S) as sock:
            if first:
                sock.sendall(first)
                sock.recv(65536)  # the response; then the connection idles
            closed[name] = seconds_until_closed(sock, dribble)

    slow_head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200
    checks = [
        ("idle new", gateway.http_port, b"", b""),
        ("slow head", gateway.http_port, b"", slow_head),
        ("idle keep-alive", gateway.http_port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b""),
        ("slow head after a response", gateway.http_port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", slow_head),
        ("grpc without handshake", gateway.grpc_port, b"", b""),
    ]
    threads = [threading.Thread(target=measure, args=check) for check in checks]
    streamer = threading.Thread(target=lambda: gaps.extend(stream_gaps(gateway, "edge-stream-1")))
    streamer.start()
    for thread in threads:
        thread.start()
    for thread in [*threads, streamer]:
        thread.join(timeout=CALL_TIMEOUT_S * 2)
    print({name: round(s, 2) for name, s in closed.items()}, f"stream max gap {max(gaps):.3f} s")
    for name, seconds in closed.items():
        limit = KEEP_ALIVE_S if name == "idle keep-alive" else HEAD_TIMEOUT_S
        assert seconds < limit + CLOSE_SLACK_S, (name, seconds)
    assert len(closed) == len(checks)
    assert len(gaps) >= STREAM_TOKENS // 2 and max(gaps) < MAX_TOKEN_GAP_S
    # The stream's access log line, as JSON.
    lines = [json.loads(line) for line in gateway.log().splitlines() if line.startswith("{")]
    (access,) = [line for line in lines if line.get("request_id") == "edge-stream-1"]
    assert access["logger"] == "radixserve.access" and access["route"] == "/v1/completions"
    assert access["status"] == "ok" and access["output_tokens"] == STREAM_TOKENS
    assert access["prompt_tokens"] > 0 and 0 < access["ttft_s"] <= access["total_s"]


def test_bodies_that_stall_or_dribble_are_408_and_a_client_gone_mid_body_is_no_error(gateway) -> None:
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + TOKEN.encode() + b"\r\n")
    answers: dict[str, tuple[bytes, float]] = {}

    def send(name: str, start: bytes, dribble: bytes = b"") -> None:
        with socket.create_connection(("127.0.0.1", gateway.http_port), timeout=CALL_TIMEOUT_S) as sock:
            sock.sendall(start)
            began = time.monotonic()
            sock.settimeout(0.2)
            reply = b""
            while time.monotonic() - began < CALL_TIMEOUT_S:
                try:
                    piece = sock.recv(65536)
                except TimeoutError:
                    # A byte every 0.2 s: never whole, never idle; until the answer comes, as a
                    # client stops (a byte sent as the server closes would reset the connection,
                    # and the answer with it, before it is read).
                    if dribble and not reply:
                        sock.send(dribble[:1])
                        dribble = dribble[1:]
                    continue
                if not piece:
                    break
                reply += piece
            answers[name] = (reply, time.monotonic() - began)

    checks = [
        ("stalled", head + b"Content-Length: 100\r\n\r\n{"),
        ("dribbled", head + b"Content-Length: 100\r\n\r\n{", b" " * 60),
        ("stalled chunked", head + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n"),
    ]
    threads = [threading.Thread(target=send, args=check) for check in checks]
    for thread in threads:
        thread.start()
    with socket.create_connection(("127.0.0.1", gateway.http_port), timeout=CALL_TIMEOUT_S) as sock:
        sock.sendall(head + b"Content-Length: 100\r\n\r\n{\"model\": ")  # and leaves
    for thread in threads:
        thread.join(timeout=CALL_TIMEOUT_S * 2)
    assert set(answers) == {name for name, *_ in checks}
    for name, (reply, seconds) in answers.items():
        assert reply.startswith(b"HTTP/1.1 408 "), (name, reply)
        assert b"did not arrive within 1 s" in reply, (name, reply)
        assert seconds < BODY_TIMEOUT_S + CLOSE_SLACK_S, (name, seconds)  # answered, then closed
    log = gateway.log()
    assert "Traceback" not in log and "unexpected gateway failure" not in log
    statuses = [json.loads(line).get("status") for line in log.splitlines() if line.startswith("{")]
    assert statuses.count("DEADLINE_EXCEEDED") >= len(checks) and "CANCELLED" in statuses
