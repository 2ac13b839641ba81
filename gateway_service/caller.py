"""Who sent a request: our request id, the caller's end-user id and its client key.

Both APIs build one `Caller` per request before anything else (the HTTP API from its headers,
gRPC from its metadata) and pass it down, so logs, metrics and per-client limits read the same
value whichever API the request came by.

- `request_id`: the caller's `X-Request-Id` (HTTP header or gRPC metadata, or the gRPC message's
  `request_id`) when it is short printable ASCII, else one made here; echoed back and logged.
- `user`: OpenAI's `user` field, an end-user id for logs only (any Unicode, bounded length); it
  never becomes our request id.
- `client`: what per-client limits count by: the bearer token presented (hashed, never logged),
  else the peer's address.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass

from radixserve.security import AUTH_HEADER, BEARER

REQUEST_ID_HEADER = "x-request-id"
# Hex digits of the token's SHA-256 that name a client (enough to tell tokens apart).
CLIENT_HASH_CHARS = 16


@dataclass(frozen=True, slots=True)
class Caller:
    request_id: str
    user: str = ""
    client: str = ""


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_id_from(presented: str | None, max_len: int) -> str:
    """The caller's id when usable (printable ASCII within `max_len`), else a new one."""
    if presented and len(presented) <= max_len and presented.isascii() and presented.isprintable():
        return presented
    return new_request_id()


def client_key(token: str | None, peer_host: str | None) -> str:
    """Per-client limits count by API token when one is presented, else by peer address."""
    if token:
        return "token:" + hashlib.sha256(token.encode()).hexdigest()[:CLIENT_HASH_CHARS]
    return f"peer:{peer_host or 'unknown'}"


def peer_host(grpc_peer: str) -> str:
    """`ipv4:127.0.0.1:5555` / `ipv6:[::1]:5555` -> the address without its port."""
    address = grpc_peer.split(":", 1)[1] if ":" in grpc_peer else grpc_peer
    return address.rsplit(":", 1)[0].strip("[]")


def grpc_caller(presented_id: str, context, max_id_len: int) -> Caller:
    """A gRPC call's caller: the id from `x-request-id` metadata, else `presented_id` (the
    message's `request_id`, which `check_input` validates), else a new one; the client by its
    token, else its address."""
    metadata = {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}
    request_id = request_id_from(metadata.get(REQUEST_ID_HEADER) or presented_id, max_id_len)
    auth = metadata.get(AUTH_HEADER, "")
    token = auth[len(BEARER):] if auth.startswith(BEARER) else None
    return Caller(request_id, client=client_key(token, peer_host(context.peer())))
