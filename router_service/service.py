"""`RouterService` on grpc.aio: Generate, Stream, Embed, GetStats and GetServerInfo over the engine."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from radixserve import bare_tokens
from radixserve.v1 import router_pb2, router_pb2_grpc
from router_service import convert
from router_service.core.request import Request
from router_service.engine import Engine
from router_service.events import EventQueue, StreamEvent
from router_service.errors import RouterError, WorkersUnavailable
from router_service.request_stream import RequestStream

log = logging.getLogger(__name__)


class RouterService(router_pb2_grpc.RouterServiceServicer):
    """The gRPC face of the engine. Every `RouterError` becomes its status via `convert`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Generate(
        self, request: router_pb2.RouterGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouterGenerateResponse]:
        """Stream token ids as steps produce them; the last response carries finish reason and
        usage. A caller that cancels or disconnects takes its request out of the batch."""
        generate, queue = await self._submit(convert.request_from_proto, request, context)
        ended = False
        try:
            while not ended:
                events = [await queue.get()]
                while not queue.empty():  # a slow reader gets what piled up in one message
                    events.append(queue.get_nowait())
                token_ids: list[int] = []
                logprobs = []
                for event in events:
                    if event.error is not None:
                        ended = True
                        await context.abort(*convert.status_of(event.error))
                    token_ids.extend(event.token_ids)
                    logprobs.extend(event.logprobs)
                    ended = ended or event.finished
                yield convert.response_to_proto(token_ids, logprobs, generate, ended)
        finally:
            if not ended:  # the caller cancelled or went away
                self.engine.cancel(generate)

    async def Embed(
        self, request: router_pb2.RouterEmbedRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouterEmbedResponse:
        """One prompt's embedding: queued and batched like a generation request's prefill."""
        embed, queue = await self._submit(convert.embed_request_from_proto, request, context)
        ended = False
        try:
            event = await queue.get()
            ended = True
            if event.error is not None:
                await context.abort(*convert.status_of(event.error))
            if not event.embedding:  # a bug: no vector for a finished embedding request
                await context.abort(*convert.status_of(RouterError(f"no embedding for {embed.request_id}")))
            return convert.embed_response_to_proto(event.embedding, embed)
        finally:
            if not ended:  # the caller cancelled or went away
                self.engine.cancel(embed)

    async def Stream(
        self, request_iterator: AsyncIterator[router_pb2.RouterStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouterStreamResponse]:
        """Many requests of one caller on one call, each step's updates in one message
        (request_stream.py). The call ending cancels what is still open on it."""
        metadata = context.invocation_metadata() or ()
        stream = RequestStream(self.engine, any(tuple(item) == bare_tokens.METADATA for item in metadata))

        async def read() -> None:
            try:
                async for message in request_iterator:
                    if message.HasField("open"):
                        stream.open(message.open)
                    elif message.HasField("cancel"):
                        stream.cancel(message.cancel)
            finally:
                stream.caller_done()

        reader = asyncio.ensure_future(read())
        try:
            async for response in stream.responses():
                yield response
        finally:
            reader.cancel()
            stream.close()

    async def _submit(
        self, from_proto: Callable[[Any, int], Request], message: Any, context: grpc.aio.ServicerContext,
    ) -> tuple[Request, asyncio.Queue[StreamEvent]]:
        """The request `from_proto` reads from `message`, queued; its events come on the queue.
        A `RouterError` aborts the call with its status."""
        try:
            request = from_proto(message, self.engine.config.max_request_id_bytes)
            queue = EventQueue()
            self.engine.submit(request, queue)
        except RouterError as exc:
            await context.abort(*convert.status_of(exc))
        return request, queue

    async def GetStats(
        self, request: router_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.GetStatsResponse:
        return self.engine.stats()

    async def GetServerInfo(
        self, request: router_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.GetServerInfoResponse:
        summary = self.engine.summary
        if summary is None or self.engine.scheduler is None:
            await context.abort(*convert.status_of(WorkersUnavailable("the workers are not connected")))
        return summary
