"""TLS, mTLS and bearer tokens: one set of flags and one loader for every service and client.

- `--tls-cert` / `--tls-key`: this service's PEM certificate and key; TLS is on when both are set.
- `--tls-ca`: the CA bundle a caller uses to verify the servers it calls; internal channels (gateway
  to router, router to workers, health checks) use TLS whenever it is set. With `--mtls`, servers
  require client certificates signed by it, and callers present their own `--tls-cert/--tls-key`
  (so a certificate used with `--mtls` must allow client as well as server authentication; the
  ones `radixserve.dev_certs` writes do). On the gateway, `--mtls` only makes it present its
  certificate to the routers: its public port authenticates callers by API token.
- `--internal-token-file`: a shared secret that the gateway sends to the router and the router
  to the workers (`authorization: Bearer ...`); router and workers reject calls without it. An
  alternative to mTLS, or on top of it.
- gateway only: `--api-token-file` (one token per line) and `--api-tokens` (comma-separated,
  best set as `RADIXSERVE_API_TOKENS`): callers of the public API must present one of them.

Everything is off by default, which is what `make run` on localhost wants. Files are read once, at
start-up: a missing or unreadable file stops the service with a message that names it.
"""

from __future__ import annotations

import logging
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from radixserve.flags import nested, setting

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
BEARER = "Bearer "
# Shorter secrets are guessable; dev_certs writes 64 hex characters.
MIN_TOKEN_LEN = 16
_TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + "-._~+/=")


class SecurityError(ValueError):
    """A security setting is inconsistent, or a file it names cannot be used."""


# Only the gateway (and the launcher, which hands them to it) takes the public API's tokens.
API_TOKEN_FIELDS = ("api_token_file", "api_tokens")


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """The security flags of one process, as given (paths, not contents)."""

    tls_cert: str = setting("", "PEM certificate of this service; TLS is on when set (with --tls-key)")
    tls_key: str = setting("", "PEM private key of --tls-cert")
    tls_ca: str = setting("", "PEM CA bundle that verifies the servers this process calls (TLS on "
                          "internal channels when set); with --mtls, also the CA that client "
                          "certificates must chain to")
    mtls: bool = setting(False, "require client certificates signed by --tls-ca, and present "
                         "--tls-cert as one")
    internal_token_file: str = setting("", "file with the shared secret of gateway->router->worker "
                                       "calls; router and workers reject callers without it")
    api_token_file: str = setting("", "file of public API bearer tokens, one per line; callers "
                                  "without one get UNAUTHENTICATED")
    api_tokens: tuple[str, ...] = setting((), "comma-separated public API bearer tokens (prefer the "
                                          "environment variable: command lines are visible to "
                                          "other users)")

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SecurityError("--tls-cert and --tls-key go together")
        if self.mtls and not (self.tls_ca and self.tls_cert):
            raise SecurityError("--mtls needs --tls-ca, --tls-cert and --tls-key")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)


def security_settings(*, public: bool = False) -> SecurityConfig:
    """The config field of a program's security settings; `public=True` adds the API tokens."""
    return nested(SecurityConfig, skip=() if public else API_TOKEN_FIELDS)


def security_args(config: SecurityConfig) -> list[str]:
    """The flags that give a child process the same settings (what `radixserve up` passes down).

    API tokens are not included: only the gateway takes them, and they travel in its environment.
    """
    args: list[str] = []
    for flag, value in (
        ("--tls-cert", config.tls_cert), ("--tls-key", config.tls_key),
        ("--tls-ca", config.tls_ca), ("--internal-token-file", config.internal_token_file),
    ):
        if value:
            args += [flag, value]
    if config.mtls:
        args.append("--mtls")
    return args


def read_tokens(path: str) -> list[str]:
    """Tokens from a file, one per line; blank lines and `#` comments are skipped."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SecurityError(f"cannot read token file {path}: {exc.strerror}") from exc
    tokens = [line.strip() for line in text.splitlines()]
    return [t for t in tokens if t and not t.startswith("#")]


def check_token(token: str, source: str) -> str:
    if len(token) < MIN_TOKEN_LEN:
        raise SecurityError(f"a token from {source} is shorter than {MIN_TOKEN_LEN} characters")
    if not set(token) <= _TOKEN_CHARS:
        raise SecurityError(f"a token from {source} has characters a bearer token cannot carry")
    return token


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"cannot read {what} {path}: {exc.strerror}") from exc


@dataclass(frozen=True, slots=True)
class Security:
    """What one process enforces as a server and presents as a client, loaded from files.

    `accepted_tokens` empty means the server asks for no token. `call_token` is what this process
    sends to the internal services it calls (None: nothing).
    """

    server_credentials: grpc.ServerCredentials | None = None
    accepted_tokens: tuple[str, ...] = ()
    channel_credentials: grpc.ChannelCredentials | None = None
    call_token: str | None = None

    def call_metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Metadata that carries `call_token` on every internal call (None when there is none)."""
        if self.call_token is None:
            return None
        return ((AUTH_HEADER, BEARER + self.call_token),)

    def aio_channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        if self.channel_credentials is None:
            return grpc.aio.insecure_channel(address, options=list(options))
        return grpc.aio.secure_channel(address, self.channel_credentials, options=list(options))

    def channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        if self.channel_credentials is None:
            return grpc.insecure_channel(address, options=list(options))
        return grpc.secure_channel(address, self.channel_credentials, options=list(options))


NO_SECURITY = Security()


def load_security(config: SecurityConfig, *, public: bool = False) -> Security:
    """Read every file `config` names. `public=True` (the gateway) guards the server with the
    API tokens instead of the internal token, which it only sends."""
    internal = None
    if config.internal_token_file:
        tokens = read_tokens(config.internal_token_file)
        if len(tokens) != 1:
            raise SecurityError(f"{config.internal_token_file} must hold exactly one token")
        internal = check_token(tokens[0], config.internal_token_file)
    if public:
        accepted = [*config.api_tokens]
        if config.api_token_file:
            accepted += read_tokens(config.api_token_file)
            if not accepted:
                raise SecurityError(f"{config.api_token_file} holds no token")
        accepted_tokens = tuple(check_token(t, "the API tokens") for t in accepted)
    else:
        accepted_tokens = (internal,) if internal else ()
    if (accepted_tokens or internal) and not (config.tls and config.tls_ca):
        log.warning("bearer tokens without TLS on every hop travel in plaintext: "
                    "give --tls-cert/--tls-key and --tls-ca too")
    return Security(
        # The public port authenticates callers by API token, never by client certificate.
        server_credentials=_server_credentials(config, client_auth=config.mtls and not public),
        accepted_tokens=accepted_tokens,
        channel_credentials=client_credentials(config),
        call_token=internal,
    )


def _server_credentials(config: SecurityConfig, client_auth: bool) -> grpc.ServerCredentials | None:
    if not config.tls:
        return None
    pair = (_read(config.tls_key, "TLS key"), _read(config.tls_cert, "TLS certificate"))
    if not client_auth:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials(
        [pair], root_certificates=_read(config.tls_ca, "CA bundle"), require_client_auth=True
    )


def client_credentials(config: SecurityConfig) -> grpc.ChannelCredentials | None:
    """How this process calls others: TLS when it has a CA, presenting its certificate with mTLS."""
    if config.mtls:
        return channel_credentials(config.tls_ca, config.tls_cert, config.tls_key)
    return channel_credentials(config.tls_ca)


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials | None:
    """TLS credentials that trust `ca` (and present cert/key when given); None without a CA."""
    if not ca:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "CA bundle"),
        private_key=_read(key, "TLS key") if key else None,
        certificate_chain=_read(cert, "TLS certificate") if cert else None,
    )
