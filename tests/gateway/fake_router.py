"""A scripted RouterService on 127.0.0.1 for gateway tests.

It streams a fixed list of token ids (one per response unless `chunk_size` says otherwise),
honouring `max_tokens` (LENGTH), the end-of-sequence and stop token ids (STOP, unless
`ignore_eos`), and records every request it received and every stream the caller cancelled.
`fail_with` makes Generate fail with that status before streaming anything. It has no
`Stream` call (UNIMPLEMENTED), as a router from before it: `fake_stream_router.py` has one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from radixserve.serving import start_server
from radixserve.v1 import generation_pb2, router_pb2, router_pb2_grpc

ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


@dataclass
class FakeRouterState:
    token_ids: list[int] = field(default_factory=list)
    chunk_size: int = 1
    delay_s: float = 0.0
    fail_with: grpc.StatusCode | None = None
    cached_tokens: int = 0
    # Logprob returned for every token (with `top` alternatives) when logprobs are asked for.
    logprob: float = -0.5
    requests: list[router_pb2.RouterGenerateRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    # Tokens a Stream call sent bare (fake_stream_router.py).
    num_bare_tokens: int = 0


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, info: router_pb2.GetServerInfoResponse) -> None:
        self.info = info
        self.state = FakeRouterState()
        self.server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def script(self, token_ids: list[int], **settings) -> FakeRouterState:
        """Replace the script (and forget what was recorded)."""
        self.state = FakeRouterState(token_ids=list(token_ids), **settings)
        return self.state

    async def start(self) -> None:
        self.server, health, self.port = await start_server(
            "127.0.0.1", 0, [lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(self, s)],
            [ROUTER_SERVICE],
        )
        await health.set(True)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)

    async def GetServerInfo(self, request, context):
        return self.info

    async def Stream(self, request_iterator, context):
        """A router from before `Stream` (the gateway falls back to Generate). Said explicitly:
        the generated base method raises after setting UNIMPLEMENTED, which grpc.aio reports
        as UNKNOWN now and then (the gateway's fallback rightly takes only UNIMPLEMENTED)."""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")

    async def GetStats(self, request, context):
        return router_pb2.GetStatsResponse()

    async def Generate(self, request, context):
        state = self.state
        state.requests.append(request)
        if state.fail_with is not None:
            await context.abort(state.fail_with, "scripted failure")
        stops = set(request.stop_token_ids)
        if not request.ignore_eos:
            stops.update(self.info.eos_token_ids)
        sent = 0
        try:
            while True:
                chunk: list[int] = []
                reason = 0
                while len(chunk) < state.chunk_size and reason == 0:
                    if sent >= len(state.token_ids):
                        reason = generation_pb2.FINISH_REASON_LENGTH
                        break
                    token_id = state.token_ids[sent]
                    chunk.append(token_id)
                    sent += 1
                    if token_id in stops:
                        reason = generation_pb2.FINISH_REASON_STOP
                    elif sent >= request.max_tokens:
                        reason = generation_pb2.FINISH_REASON_LENGTH
                if state.delay_s:
                    await asyncio.sleep(state.delay_s)
                response = router_pb2.RouterGenerateResponse(token_ids=chunk)
                if request.sampling.logprobs:
                    for token_id in chunk:
                        response.logprobs.append(self._logprob(token_id, request.sampling.top_logprobs))
                if reason:
                    response.finish_reason = reason
                    response.usage.CopyFrom(generation_pb2.Usage(
                        prompt_tokens=len(request.prompt_token_ids),
                        completion_tokens=sent,
                        cached_tokens=state.cached_tokens,
                    ))
                    yield response
                    state.finished.append(request.request_id)
                    return
                yield response
        except asyncio.CancelledError:
            state.cancelled.append(request.request_id)
            raise

    def _logprob(self, token_id: int, top: int) -> generation_pb2.TokenLogprob:
        state = self.state
        return generation_pb2.TokenLogprob(
            token_id=token_id,
            logprob=state.logprob,
            top_logprobs=[
                generation_pb2.TopLogprob(token_id=token_id + i, logprob=state.logprob - i)
                for i in range(top)
            ],
        )
