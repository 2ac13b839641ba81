"""The launcher's handshake check names why TLS with a service fails (and says nothing when it
works or when nothing listens yet), against a real gRPC server on loopback."""

from __future__ import annotations

import datetime
from concurrent import futures

import grpc
import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from procs import free_port
from radixserve.dev_certs import _pem_cert, _pem_key, issue, make_ca, write_dev_certs
from radixserve.health_tls import handshake_error
from radixserve.security import SecurityConfig

TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    write_dev_certs(out, [])
    # A certificate without subjectAltName, as dev_certs wrote without --hosts before.
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_cert, ca_key = make_ca(now)
    cert, key = issue(ca_cert, ca_key, "no names", [ExtendedKeyUsageOID.SERVER_AUTH], None, now)
    (out / "bare-ca.pem").write_bytes(_pem_cert(ca_cert))
    (out / "bare.pem").write_bytes(_pem_cert(cert))
    (out / "bare-key.pem").write_bytes(_pem_key(key))
    return out


def _serve(certs, cert: str, key: str) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    credentials = grpc.ssl_server_credentials([((certs / key).read_bytes(), (certs / cert).read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, f"127.0.0.1:{port}"


def test_a_certificate_that_does_not_name_the_address_is_named_as_the_cause(certs):
    server, address = _serve(certs, "bare.pem", "bare-key.pem")
    try:
        reason = handshake_error(address, SecurityConfig(tls_ca=str(certs / "bare-ca.pem")), TIMEOUT_S)
        assert reason is not None and "127.0.0.1" in reason and "mismatch" in reason, reason
        # Signed by another CA than the one given.
        reason = handshake_error(address, SecurityConfig(tls_ca=str(certs / "ca.pem")), TIMEOUT_S)
        assert reason is not None and "certificate verify failed" in reason, reason
    finally:
        server.stop(None)


def test_a_good_certificate_passes_and_nothing_listening_is_not_a_tls_error(certs):
    config = SecurityConfig(tls_ca=str(certs / "ca.pem"))
    server, address = _serve(certs, "server.pem", "server-key.pem")
    try:
        assert handshake_error(address, config, TIMEOUT_S) is None
    finally:
        server.stop(None)
    assert handshake_error(f"127.0.0.1:{free_port()}", config, TIMEOUT_S) is None
    assert handshake_error(address, SecurityConfig(), TIMEOUT_S) is None  # no CA: plaintext
