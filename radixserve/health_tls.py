"""Why a TLS handshake with a service fails, in words: what the launcher says when a child never
becomes reachable over TLS (a certificate that does not name the address, a CA that did not sign
it, a client certificate the server refuses), instead of waiting out its startup timeout.

gRPC reports all of these as UNAVAILABLE, the reason only in its own log; a handshake made
here with Python's `ssl`, with the same CA, client certificate and address the launcher's
channels use, names it.
"""

from __future__ import annotations

import socket
import ssl

from radixserve.security import SecurityConfig

# gRPC speaks HTTP/2 over TLS; a server may refuse a client that offers no such protocol.
ALPN_PROTOCOLS = ["h2"]


def handshake_error(address: str, config: SecurityConfig, timeout_s: float) -> str | None:
    """The reason a TLS handshake with `address` ("host:port") fails, or None when it succeeds,
    when `config` has no CA (plaintext channels), or when nothing accepts connections there yet
    (a service still starting is not a TLS problem)."""
    if not config.tls_ca:
        return None
    host, _, port = address.rpartition(":")
    try:
        context = ssl.create_default_context(cafile=config.tls_ca)
        if config.mtls:
            context.load_cert_chain(config.tls_cert, config.tls_key)
        context.set_alpn_protocols(ALPN_PROTOCOLS)
    except (OSError, ssl.SSLError) as exc:
        return f"cannot load the TLS files: {exc}"
    try:
        raw = socket.create_connection((host, int(port)), timeout=timeout_s)
    except OSError:
        return None
    with raw:
        try:
            with context.wrap_socket(raw, server_hostname=host.strip("[]")):
                return None
        except ssl.SSLCertVerificationError as exc:
            return f"certificate verify failed: {exc.verify_message}"
        except ssl.SSLError as exc:
            return exc.reason or str(exc)
        except OSError:
            return None
