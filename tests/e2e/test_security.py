"""TLS, mTLS and tokens on a real stack: `radixserve up` with a development CA from
`radixserve.dev_certs`, TLS on every port, mTLS and the internal token between the services, and
an API token on the gateway.

- direct calls to the router and the worker without the internal token get UNAUTHENTICATED
  (even from a caller holding a valid client certificate), and change nothing: a cached greedy
  answer is the same afterwards, and the router took no step meanwhile;
- a caller without a client certificate, or speaking plaintext, does not get through at all;
- grpcurl with `-cacert` and the token works, plaintext is refused, no token is UNAUTHENTICATED;
- the Python client and the health probe speak TLS.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from radixserve_client import Client, UnauthenticatedError
from e2e.stack import free_port_block, launch
from procs import ROOT, ServiceProcesses
from radixserve.dev_certs import _pem_cert, _pem_key, issue, make_ca
from radixserve.stack_plan import WORKER_PORT_OFFSET
from radixserve.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

GRPCURL = str(Path(sys.executable).parent / "grpcurl")
# Longer than two KV pages, so that a repeat finds whole pages in the prefix cache.
PROMPT = ("Geography quiz. Answer with one word only, and say nothing else at all. "
          "Question: which city is the capital of France? The capital of France is")
CALL_TIMEOUT_S = 60
GRPCURL_TIMEOUT_S = 60
SETTLE_TRIES = 20
SETTLE_INTERVAL_S = 0.3


def _read(path: Path) -> bytes:
    return path.read_bytes()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """The README's TLS quick start, as written: `python -m radixserve.dev_certs --out certs`."""
    folder = tmp_path_factory.mktemp("quickstart")
    subprocess.run([sys.executable, "-m", "radixserve.dev_certs", "--out", "certs"], cwd=folder,
                   check=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return folder / "certs"


@pytest.fixture(scope="module")
def secure_stack(smollm2_dir, certs):
    service_creds = grpc.ssl_channel_credentials(
        _read(certs / "ca.pem"), _read(certs / "server-key.pem"), _read(certs / "server.pem")
    )
    args = [
        "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server-key.pem"),
        "--tls-ca", str(certs / "ca.pem"), "--mtls",
        "--internal-token-file", str(certs / "internal-token"),
        "--api-token-file", str(certs / "api-token"),
    ]
    with ServiceProcesses() as procs:
        yield launch(procs, smollm2_dir, tp=1, extra_args=args, credentials=service_creds,
                     with_http=True)


def _token(certs: Path, name: str) -> str:
    return (certs / name).read_text().strip()


def _client(stack, certs: Path, token: str | None) -> Client:
    return Client(stack.gateway, tls_ca=str(certs / "ca.pem"), api_token=token)


def _greedy(stack, certs: Path):
    with _client(stack, certs, _token(certs, "api-token")) as client:
        return client.generate(PROMPT, max_tokens=8, temperature=0, timeout=CALL_TIMEOUT_S)


def _client_cert_channel(certs: Path, address: str, cert: str = "client") -> grpc.Channel:
    """A TLS channel that presents a valid client certificate, but carries no token."""
    creds = grpc.ssl_channel_credentials(
        _read(certs / "ca.pem"), _read(certs / f"{cert}-key.pem"), _read(certs / f"{cert}.pem")
    )
    return grpc.secure_channel(address, creds)


def _router_stats(stack, certs: Path) -> router_pb2.GetStatsResponse:
    metadata = (("authorization", f"Bearer {_token(certs, 'internal-token')}"),)
    with _client_cert_channel(certs, stack.router, "server") as channel:
        return router_pb2_grpc.RouterServiceStub(channel).GetStats(
            router_pb2.GetStatsRequest(), timeout=CALL_TIMEOUT_S, metadata=metadata
        )


def _settled_stats(stack, certs: Path) -> router_pb2.GetStatsResponse:
    """Router stats once the engine is idle (its last step, a release, may trail the answer)."""
    previous = _router_stats(stack, certs)
    for _ in range(SETTLE_TRIES):
        time.sleep(SETTLE_INTERVAL_S)
        current = _router_stats(stack, certs)
        if current == previous and current.num_running == 0:
            return current
        previous = current
    raise AssertionError(f"the router did not settle: {previous}")


def _poison_task() -> worker_pb2.DecodeTask:
    """What the issue's attacker sent: a reset, and token 1234 written over pages 0-10."""
    task = worker_pb2.DecodeTask(task_id=99, reset=True)
    task.entries.add(request_id="evil", token_ids=[1234] * 16, start_position=0,
                     page_ids=list(range(11)), sample=False)
    return task


def test_internal_services_refuse_callers_without_the_internal_token(secure_stack, certs):
    before = _greedy(secure_stack, certs)
    assert before.usage.completion_tokens > 0
    stats_before = _settled_stats(secure_stack, certs)
    worker = f"127.0.0.1:{secure_stack.port + WORKER_PORT_OFFSET}"
    with _client_cert_channel(certs, secure_stack.router) as channel:
        router = router_pb2_grpc.RouterServiceStub(channel)
        request = router_pb2.RouterGenerateRequest(
            request_id="direct", prompt_token_ids=[1, 2, 3], max_tokens=4
        )
        with pytest.raises(grpc.RpcError) as err:
            list(router.Generate(request, timeout=CALL_TIMEOUT_S))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            router.GetStats(router_pb2.GetStatsRequest(), timeout=CALL_TIMEOUT_S,
                            metadata=(("authorization", "Bearer not-the-internal-token"),))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with _client_cert_channel(certs, worker) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Execute(iter([_poison_task()]), timeout=CALL_TIMEOUT_S))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=CALL_TIMEOUT_S)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _router_stats(secure_stack, certs) == stats_before  # no step, no page moved
    after = _greedy(secure_stack, certs)
    assert after.text == before.text
    assert after.token_ids == before.token_ids
    assert after.usage.cached_tokens > 0  # the prefix cache survived, and was trusted


def test_undecodable_request_to_the_router_is_invalid_argument(secure_stack, certs):
    """A string field that is not UTF-8 fails in deserialization: INVALID_ARGUMENT, not UNKNOWN."""
    metadata = (("authorization", f"Bearer {_token(certs, 'internal-token')}"),)
    raw = router_pb2.RouterGenerateRequest(
        request_id="MARK", prompt_token_ids=[1, 2], max_tokens=2
    ).SerializeToString().replace(b"MARK", b"\xff\xfe\xfd\xfc")
    with _client_cert_channel(certs, secure_stack.router, "server") as channel:
        generate = channel.unary_stream("/radixserve.v1.RouterService/Generate")
        with pytest.raises(grpc.RpcError) as err:
            list(generate(raw, timeout=CALL_TIMEOUT_S, metadata=metadata))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in err.value.details()


def test_callers_without_a_client_certificate_do_not_get_through(secure_stack, certs):
    worker = f"127.0.0.1:{secure_stack.port + WORKER_PORT_OFFSET}"
    server_only = grpc.ssl_channel_credentials(_read(certs / "ca.pem"))
    for address in (secure_stack.router, worker):
        for channel in (grpc.secure_channel(address, server_only), grpc.insecure_channel(address)):
            with channel:
                stub = worker_pb2_grpc.WorkerServiceStub(channel)
                with pytest.raises(grpc.RpcError) as err:
                    stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake failed


def test_public_token_is_enforced(secure_stack, certs):
    for token in (None, "x" * 64):
        with _client(secure_stack, certs, token) as client:
            with pytest.raises(UnauthenticatedError):
                client.generate(PROMPT, max_tokens=2, timeout=CALL_TIMEOUT_S)
            with pytest.raises(UnauthenticatedError):
                client.tokenize(PROMPT, timeout=CALL_TIMEOUT_S)
    with _client(secure_stack, certs, _token(certs, "api-token")) as client:
        assert client.tokenize(PROMPT, timeout=CALL_TIMEOUT_S)


def _grpcurl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([GRPCURL, *args], capture_output=True, text=True, timeout=GRPCURL_TIMEOUT_S)


def test_grpcurl_with_the_ca_works_and_plaintext_is_refused(secure_stack, certs):
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4, "sampling": {"temperature": 0}})
    method = "radixserve.v1.GenerationService/Generate"
    header = f"authorization: Bearer {_token(certs, 'api-token')}"
    ok = _grpcurl("-cacert", str(certs / "ca.pem"), "-H", header, "-d", body,
                  secure_stack.gateway, method)
    assert ok.returncode == 0, ok.stderr
    assert '"finishReason"' in ok.stdout or '"finish_reason"' in ok.stdout
    # A TLS port never answers plaintext: grpcurl gives up after its connect timeout.
    plain = _grpcurl("-plaintext", "-connect-timeout", "2", "-H", header, "-d", body,
                     secure_stack.gateway, method)
    assert plain.returncode != 0
    no_token = _grpcurl("-cacert", str(certs / "ca.pem"), "-d", body, secure_stack.gateway, method)
    assert no_token.returncode != 0
    assert "Unauthenticated" in no_token.stderr


def test_health_probe_speaks_tls(secure_stack, certs):
    def probe(*args: str) -> int:
        return subprocess.run(
            [sys.executable, "-m", "radixserve.health_probe", "--address", secure_stack.router,
             *args], capture_output=True, timeout=CALL_TIMEOUT_S,
        ).returncode

    mtls = ["--tls-ca", str(certs / "ca.pem"), "--mtls", "--tls-cert", str(certs / "server.pem"),
            "--tls-key", str(certs / "server-key.pem")]
    assert probe(*mtls) == 0
    assert probe() == 1  # plaintext against a TLS port


def test_the_openai_client_over_https_with_the_ca(secure_stack, certs):
    base = f"https://127.0.0.1:{secure_stack.http_port}/v1"
    with httpx.Client(verify=str(certs / "ca.pem")) as http, openai.OpenAI(
        base_url=base, api_key=_token(certs, "api-token"), http_client=http, max_retries=0,
    ) as client:
        models = client.models.list()
        reply = client.completions.create(model=models.data[0].id, prompt=PROMPT, max_tokens=4,
                                          temperature=0)
    assert reply.choices[0].text and reply.usage.completion_tokens == 4


@pytest.mark.timeout(120)
def test_a_tls_handshake_failure_stops_the_launcher_at_once_naming_it(smollm2_dir, tmp_path):
    """A service certificate that names no host (what dev_certs wrote without --hosts before):
    the launcher stops as soon as the first of its services listens (all start at once: the
    router, which needs no model, is usually first), with the reason, not after its startup
    timeout."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_cert, ca_key = make_ca(now)
    cert, key = issue(ca_cert, ca_key, "no names", [ExtendedKeyUsageOID.SERVER_AUTH], None, now)
    for name, data in (("ca.pem", _pem_cert(ca_cert)), ("server.pem", _pem_cert(cert)),
                       ("server-key.pem", _pem_key(key))):
        (tmp_path / name).write_bytes(data)
    with ServiceProcesses() as procs:
        launcher = procs.start("stack", [
            sys.executable, "-m", "radixserve.launcher", "up", "--model", str(smollm2_dir),
            "--port", str(free_port_block(1)), "--device", "cpu", "--dtype", "float32",
            "--kv-cache-mb", "64", "--http-port", "0", "--metrics-port", "0",
            "--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server-key.pem"),
            "--tls-ca", str(tmp_path / "ca.pem"), "--startup-timeout-s", "300",
        ])
        assert launcher.wait(timeout=100) == 1
        output = procs.tail("stack")
    assert re.search(r"TLS handshake with (worker0|router|gateway) at 127\.0\.0\.1:\d+ failed", output), output
    assert "IP address mismatch" in output, output
