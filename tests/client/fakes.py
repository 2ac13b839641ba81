"""What the multiplexing clients' tests share: the scripted output and the requests, a gateway
whose first GenerateMany call fails, and a count of the GenerateMany calls a client opens."""

from __future__ import annotations

import grpc

from radixserve.v1 import generation_pb2, generation_pb2_grpc

TEXT = "Streaming 😀 text, 世界!"
# Requests of different kinds (plain, chat with logprobs, length-bounded); each test adds one more.
OPTIONS = [
    {"prompt": "one", "max_tokens": 50},
    {"messages": [{"role": "user", "content": "two"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 2},
    {"prompt": "three", "max_tokens": 3, "ignore_eos": True},
]


def counting_many_calls(client) -> list[int]:
    """Counts the GenerateMany calls `client` (either kind) opens (one entry each)."""
    opened: list[int] = []
    open_call = client._stub.GenerateMany

    def counted(*args, **kwargs):
        opened.append(1)
        return open_call(*args, **kwargs)

    client._stub.GenerateMany = counted
    return opened


class FailingFirstCall(generation_pb2_grpc.GenerationServiceServicer):
    """A gateway whose first GenerateMany call ends with UNAVAILABLE once every request on it
    has had a chunk; later calls answer each request with one chunk and its finish."""

    def __init__(self, num_first: int) -> None:
        self.num_calls = 0
        self.num_first = num_first

    async def GenerateMany(self, request_iterator, context):
        self.num_calls += 1
        first = self.num_calls == 1
        seen = 0
        async for message in request_iterator:
            chunk = generation_pb2.GenerateResponse(text="a", token_ids=[7])
            if first:
                seen += 1
                yield generation_pb2.ManyResponse(updates=[generation_pb2.ManyUpdate(id=message.id, response=chunk)])
                if seen == self.num_first:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the gateway went away")
            elif message.HasField("generate"):
                chunk.finish_reason = generation_pb2.FINISH_REASON_STOP
                yield generation_pb2.ManyResponse(updates=[generation_pb2.ManyUpdate(id=message.id, response=chunk)])
