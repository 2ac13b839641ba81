"""`python -m radixserve.k8s_secret` against a small fake API server on 127.0.0.1: it creates the
TLS Secret once (without the CA's key), and leaves an existing one alone."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cryptography import x509

from radixserve.k8s_secret import SECRET_FILES, main

TOKEN = "service-account-token"


class FakeApi(BaseHTTPRequestHandler):
    secrets: dict[str, dict] = {}
    calls: list[tuple[str, str, str]] = []

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.calls.append(("GET", self.path, self.headers["Authorization"]))
        name = self.path.rsplit("/", 1)[-1]
        if name in self.secrets:
            self._reply(200, self.secrets[name])
        else:
            self._reply(404, {"message": "not found"})

    def do_POST(self) -> None:
        self.calls.append(("POST", self.path, self.headers["Authorization"]))
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.secrets[body["metadata"]["name"]] = body
        self._reply(201, body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def api(tmp_path):
    FakeApi.secrets, FakeApi.calls = {}, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    account = tmp_path / "account"
    account.mkdir()
    (account / "token").write_text(TOKEN)
    (account / "namespace").write_text("radixserve")
    try:
        yield f"http://127.0.0.1:{server.server_port}", account
    finally:
        server.shutdown()


def test_creates_the_secret_once_and_keeps_it(api):
    url, account = api
    args = ["--api-url", url, "--account-dir", str(account), "--hosts", "radixserve-router"]
    assert main(args) == 0
    secret = FakeApi.secrets["radixserve-tls"]
    assert sorted(secret["data"]) == sorted(SECRET_FILES)
    assert "ca-key.pem" not in secret["data"]
    server = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["server.pem"]))
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "radixserve-router" in names.get_values_for_type(x509.DNSName)
    assert [c[:2] for c in FakeApi.calls] == [
        ("GET", "/api/v1/namespaces/radixserve/secrets/radixserve-tls"),
        ("POST", "/api/v1/namespaces/radixserve/secrets"),
    ]
    assert all(c[2] == f"Bearer {TOKEN}" for c in FakeApi.calls)
    assert main(args) == 0
    assert FakeApi.calls[-1][0] == "GET"  # the second run only looked
    assert FakeApi.secrets["radixserve-tls"] is secret
