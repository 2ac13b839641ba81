"""Embedding requests in the scheduler: prefill-only (one step's "token", then done), batched with
generation; last-token pooling reuses the cached prefix, mean pooling computes every position;
the prompt's whole pages enter the cache either way and nothing beyond them."""

from __future__ import annotations

from router_service import convert
from router_service.core.request import Pooling, Request
from router_service.core.scheduler import Policy, Scheduler
from radixserve.v1 import worker_pb2

PAGE_SIZE = 4


def make_scheduler() -> Scheduler:
    return Scheduler(num_pages=64, page_size=PAGE_SIZE, max_batch_tokens=64, max_running_requests=8,
                     policy=Policy.FCFS, context_len=256, eos_token_ids=frozenset({2}))


def run_to_end(scheduler: Scheduler) -> list:
    """Step until idle, sampling token 7 everywhere; the plans, in order."""
    plans = []
    while True:
        plan = scheduler.schedule()
        if not plan.entries:
            return plans
        plans.append(plan)
        scheduler.complete(plan, [7] * sum(entry.sample for entry in plan.entries))


def test_pooling_decides_what_the_cache_may_serve() -> None:
    scheduler = make_scheduler()
    prompt = list(range(10, 23))  # 13 tokens: 3 whole pages
    scheduler.add(Request(request_id="warm", prompt_ids=prompt, max_tokens=1))
    run_to_end(scheduler)
    last = Request(request_id="last", prompt_ids=prompt, max_tokens=1, pooling=Pooling.LAST)
    mean = Request(request_id="mean", prompt_ids=prompt, max_tokens=1, pooling=Pooling.MEAN, normalize=True)
    generate = Request(request_id="gen", prompt_ids=[5, 6, 7], max_tokens=3)
    for request in (last, mean, generate):
        scheduler.add(request)
    plans = run_to_end(scheduler)
    first = {entry.request.request_id: entry for entry in plans[0].entries}
    assert set(first) == {"last", "mean", "gen"}  # one step, batched together
    assert first["last"].start_position == 12 and first["last"].sample  # 3 cached pages
    assert first["mean"].start_position == 0 and len(first["mean"].token_ids) == 13 and first["mean"].sample
    assert last.num_cached_tokens == 12 and mean.num_cached_tokens == 0
    # One step each: the vector is their only "output".
    assert [entry.request.request_id for plan in plans[1:] for entry in plan.entries] == ["gen", "gen"]
    assert last.num_output == mean.num_output == 1
    task = convert.task_to_proto(plans[0], 1, 0)
    news = {entry.request_id: entry.new_request for entry in task.entries}
    pooling = {name: new.pooling for name, new in news.items()}
    assert pooling["mean"] == worker_pb2.Pooling(mode=worker_pb2.POOLING_MODE_MEAN, normalize=True)
    assert pooling["last"].mode == worker_pb2.POOLING_MODE_LAST and not pooling["gen"].mode
    assert list(news["last"].cached_token_ids) == prompt[:12] and not news["mean"].cached_token_ids
    # Only whole prompt pages are cached, and every page came back.
    assert scheduler.cache.match_prefix(prompt + [7]).matched_len == 12
    assert scheduler.allocator.num_free + scheduler.cache.evictable_size == 64
