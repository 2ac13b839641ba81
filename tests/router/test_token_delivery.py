"""When a step's tokens reach their callers: after the next task is on its way to the workers.

The workers wait for the next task while the router hands the last step's tokens to the callers'
streams (each a gRPC write to the gateway); sending the task first keeps those writes out of that
wait. Checked on the engine's own order of operations over real gRPC with a fake worker, overlap
off, for a request decoding alone and for several together: every hand-over of tokens is right
after a task was sent, except the last ones (nothing left to send), and every token arrives.
"""

from __future__ import annotations

import asyncio

import pytest

from router.fake_model import expected_tokens
from router.harness import collect, generate_request, running_router
from router_service.config import RouterConfig
from router_service.core.speculation import SpeculationConfig
from router_service.engine import Engine
from router_service.worker_group import WorkerGroup

CONFIG = RouterConfig(overlap=False, speculation=SpeculationConfig(speculative=False))


@pytest.fixture
def operations(monkeypatch) -> list[tuple[str, int]]:
    """("send", task id) and ("flush", events handed over) in the order the engine does them."""
    log: list[tuple[str, int]] = []
    send, flush = WorkerGroup.send, Engine._flush

    async def logged_send(self, task, timeout_s):
        await send(self, task, timeout_s)
        log.append(("send", task.task_id))

    def logged_flush(self):
        log.append(("flush", len(self._outbox)))
        flush(self)

    monkeypatch.setattr(WorkerGroup, "send", logged_send)
    monkeypatch.setattr(Engine, "_flush", logged_flush)
    return log


@pytest.mark.parametrize("num_requests", [1, 3])
def test_tokens_are_handed_over_after_the_next_task_is_sent(operations, num_requests) -> None:
    prompts = [[5 + i, 9, 12 + i, 7] for i in range(num_requests)]
    requests = [generate_request(prompt, 8 + 3 * i) for i, prompt in enumerate(prompts)]

    async def run() -> list[list[int]]:
        async with running_router([64], CONFIG, page_size=4) as h:
            results = await asyncio.gather(*(collect(h.stub, request) for request in requests))
        return [tokens for tokens, _, _ in results]

    outputs = asyncio.run(run())
    assert outputs == [expected_tokens(prompt, request.max_tokens, eos_every=0) for prompt, request in zip(prompts, requests)]
    handovers = [i for i, (kind, count) in enumerate(operations) if kind == "flush" and count > 0]
    last_send = max(i for i, (kind, _) in enumerate(operations) if kind == "send")
    # Decode steps hand over tokens: all but the hand-overs after the last task go right after a send.
    assert len(handovers) >= max(request.max_tokens for request in requests) - 1
    assert all(operations[i - 1][0] == "send" for i in handovers if i < last_send)
    assert sum(1 for i in handovers if i > last_send) <= num_requests + 1
