"""A Generate call's chunks by way of a mailbox, so that its plain tokens take the lane.

The lane (plain_lane.py) hands a request's bare tokens to a sink from the router stream's
reader, without waking the request's task and its chain of generators; a Generate handler has
to write each chunk itself, so it cannot be that sink. Here the request runs as a task of its
own whose chunks, by the lane or by its stream, go to a mailbox (choice_streams.py, as an HTTP
request's choices do), and the handler writes what the mailbox holds at each wake-up: one
chunk, or, when several piled up while grpc wrote the last one, those chunks merged into one
response (as the router stream merges a slow reader's updates), so a caller behind the stream
gets fewer, larger messages.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from gateway_service.choice_streams import ChoiceStreams
from gateway_service.plain_lane import Sink
from radixserve.v1 import generation_pb2

GenerateRequest = generation_pb2.GenerateRequest
Chunk = generation_pb2.GenerateResponse


def merged(chunks: list[Chunk]) -> Chunk:
    """One response that says what `chunks` say in order: their text, reasoning text, token
    ids, logprobs and tool calls one after another; the last one's finish reason and usage
    (only a request's last chunk has them)."""
    if len(chunks) == 1:
        return chunks[0]
    response = Chunk(text="".join(chunk.text for chunk in chunks),
                     reasoning_text="".join(chunk.reasoning_text for chunk in chunks))
    for chunk in chunks:
        response.token_ids.extend(chunk.token_ids)
        response.logprobs.extend(chunk.logprobs)
        response.tool_calls.extend(chunk.tool_calls)
    last = chunks[-1]
    response.finish_reason = last.finish_reason
    if last.HasField("usage"):
        response.usage.CopyFrom(last.usage)
    return response


async def mailbox_chunks(start: Callable[[GenerateRequest, Sink], AsyncIterator[Chunk]],
                         request: GenerateRequest) -> AsyncIterator[Chunk]:
    """The chunks of `start(request, sink)` (the servicer's `generate` with `sink`), run as a
    task of its own (choice_streams.py); what piled up between two reads comes merged. Its
    failure is raised here after the chunks before it; leaving early (or being cancelled)
    cancels it, and so its router call."""
    streams = ChoiceStreams(start, [request])
    try:
        async for batch in streams.batches():
            yield merged([chunk for _, chunk in batch])
    finally:
        await streams.aclose()
