"""What the engine tells a request's caller: its events, and the sinks they go to."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from radixserve.v1 import generation_pb2
from router_service.errors import RouterError


@dataclass(slots=True)
class StreamEvent:
    """New tokens for one request; `finished` on its last event; `error` when it failed."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)
    finished: bool = False
    error: RouterError | None = None
    # An embedding request's vector (on its one, finished, event).
    embedding: list[float] = field(default_factory=list)


class EventSink(Protocol):
    """Where one request's events go: Generate's queue, or a Stream call's (request_stream.py).
    `put_token` is an event of one token and nothing else (no logprobs, not the request's last):
    the common one, which a sink may take without the engine building a `StreamEvent`."""

    def put_nowait(self, event: StreamEvent) -> None: ...

    def put_token(self, token_id: int) -> None: ...


class EventQueue(asyncio.Queue):
    """An `EventSink` that queues every event (Generate's)."""

    def put_token(self, token_id: int) -> None:
        self.put_nowait(StreamEvent([token_id], []))
