"""The scripted fake router with `RouterService.Stream` too (the plain `FakeRouter` has only
Generate, so the gateway falls back to a call per request there).

On Stream each opened request walks the script as Generate does, one update per token (usage
on every update, as the real router sends it), and `chunk_size` consecutive updates of a
request go out in one message: several updates of one request waiting for the gateway at once,
which is what a gateway behind the router's steps sees. To a caller that asks for bare tokens
(the gateway does), a token that is neither the request's first nor its last and has no logprobs
goes as a bare token, as the router sends it, unless the message already has an update of the
request (the router's rule: a message's bare tokens are read before its updates).
"""

from __future__ import annotations

import asyncio

from gateway.fake_router import FakeRouter
from radixserve import bare_tokens
from radixserve.v1 import generation_pb2, router_pb2


class StreamingFakeRouter(FakeRouter):
    async def Stream(self, request_iterator, context):
        messages: asyncio.Queue[router_pb2.RouterStreamResponse] = asyncio.Queue()
        serving: set[asyncio.Task] = set()

        async def read() -> None:
            async for message in request_iterator:
                if message.HasField("open"):
                    task = asyncio.ensure_future(self._serve(message.open, messages, bare_ok))
                    serving.add(task)
                    task.add_done_callback(serving.discard)
                elif message.HasField("cancel"):
                    self.state.cancelled.append(message.cancel)

        bare_ok = any(tuple(item) == bare_tokens.METADATA for item in context.invocation_metadata() or ())
        reader = asyncio.ensure_future(read())
        try:
            while True:  # the gateway keeps its call open; it ends by cancelling it
                yield await messages.get()
        finally:
            reader.cancel()
            for task in list(serving):
                task.cancel()

    async def _serve(self, request: router_pb2.RouterGenerateRequest,
                     messages: asyncio.Queue[router_pb2.RouterStreamResponse], bare_ok: bool) -> None:
        state = self.state
        state.requests.append(request)
        if state.fail_with is not None:  # as Generate's scripted failure: the request's last update
            messages.put_nowait(router_pb2.RouterStreamResponse(updates=[router_pb2.RouterStreamUpdate(
                request_id=request.request_id, error_code=state.fail_with.value[0], error_message="scripted failure")]))
            return
        if not state.token_ids:  # nothing scripted: as Generate, a finish without tokens
            update = router_pb2.RouterStreamUpdate(request_id=request.request_id)
            update.response.finish_reason = generation_pb2.FINISH_REASON_LENGTH
            update.response.usage.prompt_tokens = len(request.prompt_token_ids)
            update.response.usage.cached_tokens = state.cached_tokens
            messages.put_nowait(router_pb2.RouterStreamResponse(updates=[update]))
            state.finished.append(request.request_id)
            return
        stops = set(request.stop_token_ids)
        if not request.ignore_eos:
            stops.update(self.info.eos_token_ids)
        group: list[router_pb2.RouterStreamUpdate] = []
        bare: list[int] = []
        for sent, token_id in enumerate(state.token_ids[:request.max_tokens], start=1):
            last = token_id in stops or sent == min(len(state.token_ids), request.max_tokens)
            if bare_ok and sent > 1 and not last and not request.sampling.logprobs and not group:
                bare.append(token_id)
                state.num_bare_tokens += 1
            else:
                update = router_pb2.RouterStreamUpdate(request_id=request.request_id)
                response = update.response
                response.token_ids.append(token_id)
                if request.sampling.logprobs:
                    response.logprobs.append(self._logprob(token_id, request.sampling.top_logprobs))
                response.usage.prompt_tokens = len(request.prompt_token_ids)
                response.usage.completion_tokens = sent
                response.usage.cached_tokens = state.cached_tokens
                if last:
                    response.finish_reason = (generation_pb2.FINISH_REASON_STOP if token_id in stops
                                              else generation_pb2.FINISH_REASON_LENGTH)
                group.append(update)
            if len(group) + len(bare) == state.chunk_size or last:
                messages.put_nowait(router_pb2.RouterStreamResponse(
                    updates=group, bare_request_ids=[request.request_id] * len(bare), bare_token_ids=bare))
                group, bare = [], []
                if state.delay_s:
                    await asyncio.sleep(state.delay_s)
            if last:
                state.finished.append(request.request_id)
                return
