"""A development CA, certificates and an internal token, for turning TLS and auth on quickly.

    python -m radixserve.dev_certs --out DIR --hosts gateway,router,worker-0,worker-1

writes into DIR:
- `ca.pem` (the CA certificate: `--tls-ca`, and grpcurl's `-cacert`) and `ca-key.pem`;
- `server.pem` / `server-key.pem`: one certificate for every service (`--tls-cert/--tls-key`),
  valid for the given host names, `localhost` and `127.0.0.1`, usable for server and client
  authentication (a service presents it as its client certificate under `--mtls`);
- `client.pem` / `client-key.pem`: a client-only certificate for callers (grpcurl `-cert/-key`);
- `internal-token` (`--internal-token-file`) and `api-token` (`--api-token-file`).

Certificates are 0644; keys and tokens are 0600 by default, so only the user who ran this (the
services' user, when it runs in their image) can read them. When the services run under another
uid, give `--secret-mode 0640` and a group they share (compose: the same image user; Kubernetes:
`fsGroup`). Existing files are kept unless `--force`: a CA a deployment already trusts is not
replaced behind its back. For production, mount certificates from your own CA instead.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ALWAYS_HOSTS = ("localhost", "127.0.0.1")
VALID_DAYS = 365
TOKEN_BYTES = 32
CERT_MODE = 0o644
DEFAULT_SECRET_MODE = 0o600
FILES = ("ca.pem", "ca-key.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem",
         "internal-token", "api-token")


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "radixserve development"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys([*hosts, *ALWAYS_HOSTS]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _builder(subject: str, issuer: x509.Name, public_key, now: datetime.datetime) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate small clock skew
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )


def make_ca(now: datetime.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    cert = (
        _builder("radixserve development CA", _name("radixserve development CA"), key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False,
        ), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def issue(
    ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, common_name: str,
    usages: Sequence[x509.ObjectIdentifier], hosts: Sequence[str] | None, now: datetime.datetime,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate signed by the CA; `hosts` (plus `ALWAYS_HOSTS`, even when empty) become its
    subjectAltNames, None means none (a client-only certificate)."""
    key = _key()
    builder = (
        _builder(common_name, ca_cert.subject, key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    )
    if hosts is not None:
        builder = builder.add_extension(_san(hosts), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, mode: int) -> None:
    # The mode is set before anything is written, so a secret is never readable by others, even
    # for a moment (fchmod as well as O_CREAT's mode: that one is masked by the umask, and does
    # not apply to a file that already exists).
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    os.fchmod(fd, mode)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def write_dev_certs(out: Path, hosts: Sequence[str], secret_mode: int = DEFAULT_SECRET_MODE) -> None:
    """Write every file of the module docstring into `out` (created when missing)."""
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_cert, ca_key = make_ca(now)
    server = issue(ca_cert, ca_key, "radixserve service",
                   [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], hosts, now)
    client = issue(ca_cert, ca_key, "radixserve client", [ExtendedKeyUsageOID.CLIENT_AUTH], None, now)
    _write(out / "ca.pem", _pem_cert(ca_cert), CERT_MODE)
    _write(out / "ca-key.pem", _pem_key(ca_key), secret_mode)
    for stem, (cert, key) in (("server", server), ("client", client)):
        _write(out / f"{stem}.pem", _pem_cert(cert), CERT_MODE)
        _write(out / f"{stem}-key.pem", _pem_key(key), secret_mode)
    for name in ("internal-token", "api-token"):
        _write(out / name, (secrets.token_hex(TOKEN_BYTES) + "\n").encode(), secret_mode)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m radixserve.dev_certs", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", required=True, type=Path, help="folder to write into")
    parser.add_argument("--hosts", default="", help="comma-separated host names (and IPs) the "
                        "services are reached by; localhost and 127.0.0.1 are always included")
    parser.add_argument("--secret-mode", default=oct(DEFAULT_SECRET_MODE),
                        type=lambda text: int(text, 8), help="file mode of keys and tokens, octal "
                        "(default: %(default)s; 0640 lets a shared group read them)")
    parser.add_argument("--force", action="store_true", help="replace files that already exist")
    args = parser.parse_args(argv)
    existing = [name for name in FILES if (args.out / name).exists()]
    if existing and not args.force:
        print(f"dev_certs: {args.out} already holds {', '.join(existing)}; keeping them "
              "(--force replaces them)", file=sys.stderr)
        return 0
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    write_dev_certs(args.out, hosts, args.secret_mode)
    print(f"dev_certs: wrote a development CA, certificates and tokens into {args.out} "
          f"(hosts: {', '.join([*hosts, *ALWAYS_HOSTS])})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
