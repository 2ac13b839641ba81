"""The worker connection: a stream of an old connection that reports its end late must not mark
a newer connection broken, while the end of a current stream still does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc
import pytest

from radixserve.security import Security
from radixserve.v1 import worker_pb2
from router.fake_worker import start_fake_worker
from router_service.worker_group import WorkerGroup

CONNECT_TIMEOUT_S = 5.0
STEP_TIMEOUT_S = 5.0
# How late every stream reports its end: longer than a reconnect takes on loopback.
LATE_S = 0.5


class _LateEndCall:
    """A real `Execute` call whose done callbacks run `LATE_S` after it ended (as they may on a
    busy event loop)."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self._call = call

    def add_done_callback(self, callback: Callable[[object], None]) -> None:
        loop = asyncio.get_running_loop()
        self._call.add_done_callback(lambda _call: loop.call_later(LATE_S, callback, self))

    def __getattr__(self, name: str) -> object:
        return getattr(self._call, name)


class _LateEndChannel:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel

    def stream_stream(self, *args: object, **kwargs: object) -> Callable[..., _LateEndCall]:
        start = self._channel.stream_stream(*args, **kwargs)
        return lambda *call_args, **call_kwargs: _LateEndCall(start(*call_args, **call_kwargs))

    def __getattr__(self, name: str) -> object:
        return getattr(self._channel, name)


class _LateEnds(Security):
    def aio_channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        return _LateEndChannel(super().aio_channel(address, options))  # type: ignore[return-value]


@pytest.mark.timeout(30)
def test_a_stream_of_an_old_connection_ending_late_does_not_break_the_new_one() -> None:
    async def scenario() -> None:
        server, port, _ = await start_fake_worker(num_pages=8)
        group = WorkerGroup((f"127.0.0.1:{port}",), CONNECT_TIMEOUT_S, _LateEnds())
        try:
            await group.connect()
            await group.connect()  # cancels the first connection's stream; it reports that late
            await asyncio.sleep(2 * LATE_S)
            assert not group.broken.is_set()
            result = await group.execute(worker_pb2.DecodeTask(task_id=1, reset=True), STEP_TIMEOUT_S)
            assert result.task_id == 1
            await server.stop(0)  # the current stream ends: that does break the connection
            await asyncio.wait_for(group.broken.wait(), STEP_TIMEOUT_S)
        finally:
            await group.close()
            await server.stop(0)

    asyncio.run(scenario())
