"""The TLS and token settings: what fits together, what is refused at start-up, and the flags a
launcher passes down."""

from __future__ import annotations

import subprocess
import sys

import pytest

from procs import ROOT
from radixserve.dev_certs import write_dev_certs
from radixserve.security import (
    SecurityConfig,
    SecurityError,
    load_security,
    security_args,
)
from router_service.config import config_from_args


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    write_dev_certs(out, [])
    return out


@pytest.mark.parametrize("args, message", [
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--mtls", "--tls-cert", "c.pem", "--tls-key", "k.pem"], "--mtls needs --tls-ca"),
])
def test_inconsistent_flags_are_refused(args, message, capsys):
    with pytest.raises(SystemExit):
        config_from_args(args)
    assert message in capsys.readouterr().err


def test_unusable_files_are_refused(certs, tmp_path):
    short = tmp_path / "short"
    short.write_text("tooshort\n")
    two = tmp_path / "two"
    two.write_text("a" * 32 + "\n" + "b" * 32 + "\n")
    for config, message in [
        (SecurityConfig(internal_token_file=str(tmp_path / "missing")), "cannot read token file"),
        (SecurityConfig(internal_token_file=str(short)), "shorter than"),
        (SecurityConfig(internal_token_file=str(two)), "exactly one token"),
        (SecurityConfig(api_tokens=("has space in it 1234",)), "characters a bearer token cannot carry"),
        (SecurityConfig(tls_cert=str(tmp_path / "nope.pem"), tls_key=str(certs / "server-key.pem")),
         "cannot read TLS certificate"),
    ]:
        with pytest.raises(SecurityError, match=message):
            load_security(config, public=True)


def test_roles_of_the_tokens(certs):
    config = SecurityConfig(
        tls_cert=str(certs / "server.pem"), tls_key=str(certs / "server-key.pem"),
        tls_ca=str(certs / "ca.pem"), mtls=True,
        internal_token_file=str(certs / "internal-token"), api_token_file=str(certs / "api-token"),
    )
    internal = (certs / "internal-token").read_text().strip()
    api = (certs / "api-token").read_text().strip()
    gateway = load_security(config, public=True)
    assert gateway.accepted_tokens == (api,)
    assert gateway.call_metadata() == (("authorization", f"Bearer {internal}"),)
    router = load_security(config)
    assert router.accepted_tokens == (internal,)
    assert router.server_credentials is not None and router.channel_credentials is not None
    assert security_args(config) == [
        "--tls-cert", config.tls_cert, "--tls-key", config.tls_key, "--tls-ca", config.tls_ca,
        "--internal-token-file", config.internal_token_file, "--mtls",
    ]


def test_a_service_with_an_unreadable_file_says_which_and_exits(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "router_service", "--port", "0",
         "--internal-token-file", str(tmp_path / "missing")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "cannot read token file" in result.stderr
    assert "Traceback" not in result.stderr
