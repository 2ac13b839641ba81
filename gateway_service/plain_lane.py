"""A request's plain tokens handed to its caller without waking the request's task.

Most of a stream is bare tokens (router.proto): one token, nothing else new. Through the
request's task, each one wakes the task and climbs its chain of generators (the router stream,
failover, the servicer, metrics) to the caller's outbox. A caller that takes chunks by a sink (a
GenerateMany call's outbox, an HTTP request's mailbox) lets the router stream's reader do a bare
token's whole way in place instead: the assembler's plain add, the chat's splitter, the metrics
(`RequestObservation.observed`) and the sink, the same steps in the same order as the chain
would take them. The reader uses the lane only while the task waits with nothing queued
(router_stream.py), so order holds.

A request with stop strings has no lane: its text may end at any token, and ending is the task's
(it cancels the router call). A token whose text is not cheap to make here (the detokenizer
holds a long window) is declined and takes the task's way, where it goes to the decode threads.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway_service.chat_output import ChatOutputSplitter
from gateway_service.output import OutputAssembler
from gateway_service.router_stream import Lane
from radixserve.v1 import generation_pb2

Sink = Callable[[generation_pb2.GenerateResponse], None]


def plain_lane(assembler: OutputAssembler, splitter: ChatOutputSplitter | None, sink: Sink) -> Lane | None:
    """The lane of a request assembled by `assembler` (None where it has stop strings)."""
    if assembler.has_stops:
        return None

    def lane(token_id: int) -> bool:
        token_ids = [token_id]
        if assembler.finished or not assembler.is_cheap(token_ids):
            return False
        chunk = assembler.add_plain(token_ids)
        if chunk is not None:
            if splitter is not None:
                splitter.apply(chunk)
            sink(chunk)
        return True

    return lane
