"""`python -m radixserve.dev_certs`: a CA, certificates for the named hosts, tokens, safe modes."""

from __future__ import annotations

import stat
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from radixserve.dev_certs import FILES, main
from radixserve.security import MIN_TOKEN_LEN, read_tokens


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_writes_a_ca_and_certificates_for_the_hosts(tmp_path):
    assert main(["--out", str(tmp_path), "--hosts", "router,worker-0,10.0.0.7"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FILES)
    ca, server, client = (_cert(tmp_path / n) for n in ("ca.pem", "server.pem", "client.pem"))
    for cert in (server, client):
        cert.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"router", "worker-0", "localhost"} <= set(names.get_values_for_type(x509.DNSName))
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {"10.0.0.7", "127.0.0.1"}
    usages = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages)
    for name in ("ca.pem", "server.pem", "client.pem"):
        assert _mode(tmp_path / name) == 0o644
    for name in ("ca-key.pem", "server-key.pem", "client-key.pem", "internal-token", "api-token"):
        assert _mode(tmp_path / name) == 0o600
    tokens = [read_tokens(str(tmp_path / n)) for n in ("internal-token", "api-token")]
    assert all(len(t) == 1 and len(t[0]) >= MIN_TOKEN_LEN for t in tokens)
    assert tokens[0] != tokens[1]


def test_without_hosts_the_server_certificate_names_localhost_and_loopback(tmp_path):
    assert main(["--out", str(tmp_path)]) == 0
    server = _cert(tmp_path / "server.pem")
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == {"localhost"}
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {"127.0.0.1"}


def test_keeps_existing_files_unless_forced(tmp_path):
    main(["--out", str(tmp_path)])
    ca = (tmp_path / "ca.pem").read_bytes()
    main(["--out", str(tmp_path)])
    assert (tmp_path / "ca.pem").read_bytes() == ca
    main(["--out", str(tmp_path), "--force", "--secret-mode", "0640"])
    assert (tmp_path / "ca.pem").read_bytes() != ca
    assert _mode(tmp_path / "server-key.pem") == 0o640
