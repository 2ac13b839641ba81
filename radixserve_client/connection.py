"""How a client reaches the gateway: plaintext or TLS, with or without an API token."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from radixserve.security import AUTH_HEADER, BEARER
from radixserve.v1 import generation_pb2_grpc

DEFAULT_ADDRESS = "localhost:50051"


@dataclass(frozen=True, slots=True)
class Connection:
    """Channel credentials (None: plaintext) and the metadata every call carries."""

    credentials: grpc.ChannelCredentials | None = None
    metadata: tuple[tuple[str, str], ...] | None = None

    def channel(self, address: str) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(address)
        return grpc.secure_channel(address, self.credentials)

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(address)
        return grpc.aio.secure_channel(address, self.credentials)


def connection(
    *,
    tls: bool = False,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    api_token: str | None = None,
) -> Connection:
    """TLS when `tls` or any file is given: the server is verified against `tls_ca` (else the
    system's roots); `tls_cert/tls_key` are a client certificate for servers that ask for one.
    `api_token` goes in `authorization: Bearer ...` on every call."""
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key go together")
    credentials = None
    if tls or tls_ca or tls_cert:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=Path(tls_ca).read_bytes() if tls_ca else None,
            private_key=Path(tls_key).read_bytes() if tls_key else None,
            certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None,
        )
    metadata = ((AUTH_HEADER, BEARER + api_token),) if api_token else None
    return Connection(credentials, metadata)


class Endpoint:
    """What `Client` and `AsyncClient` share: the address, the channel, the stub and the metadata
    of every call. Subclasses say which kind of channel with `asynchronous`."""

    asynchronous = False

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        tls: bool = False,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        api_token: str | None = None,
    ) -> None:
        self.address = address
        link = connection(tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, api_token=api_token)
        self._metadata = link.metadata
        self._channel = link.aio_channel(address) if self.asynchronous else link.channel(address)
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
