"""Overlap scheduling in the scheduler, without gRPC: step N+1 is planned and run on the fake
model before step N's tokens are applied, exactly as the engine does it with overlap on.

Outputs must equal what the fake model gives without any router (so overlap on and off agree),
across EOS, stop ids, `max_tokens`, the context length, cancellations at any step and
retraction in tiny pools; the page bookkeeping must be whole after every idle moment and at the
end (free + cached == total, nothing owned, nothing locked).
"""

from __future__ import annotations

import random
from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.fake_model import EOS_TOKEN_ID, FakeEntry, FakeModel, expected_tokens
from router.test_scheduler import PAGE_SIZE, check_no_leak
from router_service.core.request import FinishReason, Request
from router_service.core.scheduler import Policy, Scheduler
from router_service.core.step_plan import StepPlan

MAX_STEPS = 20_000


class LookaheadDriver:
    """The engine's step loop over a fake model, one step ahead when the plan allows it.

    The fake runs a task when it is sent (workers run tasks in the order sent); the router side
    learns its tokens only when it finishes that task, one step later.
    """

    def __init__(self, scheduler: Scheduler, model: FakeModel, overlap: bool = True) -> None:
        self.scheduler = scheduler
        self.model = model
        self.overlap = overlap
        self.in_flight: deque[tuple[StepPlan, list[int]]] = deque()
        self.last_sampled: dict[str, int] = {}
        self.num_referred = 0  # entries sent with a token they did not carry
        self.num_stale = 0  # entries whose work was discarded

    def _send(self, plan: StepPlan) -> None:
        entries = []
        for entry in plan.entries:
            request_id = entry.request.request_id
            token_ids = list(entry.token_ids)
            if entry.after_sampled:
                assert self.in_flight, "an entry refers to a token with no step in flight"
                token_ids.insert(0, self.last_sampled[request_id])
                self.num_referred += 1
            entries.append(FakeEntry(
                request_id=request_id, token_ids=token_ids, start_position=entry.start_position,
                page_ids=entry.new_page_ids, sample=entry.sample, new_request=entry.new_request,
                cached_token_ids=entry.cached_token_ids,
            ))
        tokens = self.model.execute(False, plan.release_request_ids, entries)
        sampling = [entry for entry in plan.entries if entry.sample]
        self.last_sampled = {e.request.request_id: t for e, t in zip(sampling, tokens)}
        self.in_flight.append((plan, tokens))
        assert len(self.in_flight) <= 2, "more than one step ahead"

    def _finish_oldest(self) -> None:
        plan, tokens = self.in_flight.popleft()
        self.num_stale += sum(entry.is_stale for entry in plan.entries)
        self.scheduler.complete(plan, tokens)

    def step(self) -> bool:
        """One turn of the loop; True when it went idle (nothing planned, nothing in flight)."""
        ahead = self.in_flight[-1][0] if self.in_flight else None
        if ahead is not None and not (self.overlap and ahead.allows_lookahead):
            self._finish_oldest()
            return False
        plan = self.scheduler.schedule()
        assert all(request.finish_reason is not FinishReason.FAILED for request in plan.ended)
        if not plan.sends_task:
            if ahead is not None:
                self._finish_oldest()
                return False
            if plan.is_empty:
                assert self.scheduler.audit_when_idle() == []
                return True
            return False
        self._send(plan)
        if ahead is not None:
            self._finish_oldest()
        if not self.overlap:
            self._finish_oldest()
        return False


def scheduler_for(num_pages: int, context_len: int, **options) -> Scheduler:
    settings_ = dict(max_batch_tokens=32, max_running_requests=6, policy=Policy.LPM)
    settings_.update(options)
    return Scheduler(num_pages=num_pages, page_size=PAGE_SIZE, context_len=context_len,
                     eos_token_ids=frozenset({EOS_TOKEN_ID}), **settings_)


def run(driver: LookaheadDriver, arrivals: list[list[Request]], cancel_at: dict[int, int]) -> list[Request]:
    """Add a batch of `arrivals` per step; at step s cancel the `cancel_at[s]`-th request added
    so far (if it is still going). Returns the cancelled requests."""
    scheduler = driver.scheduler
    arrivals = list(arrivals)
    added: list[Request] = []
    cancelled = []
    for step in range(MAX_STEPS):
        if arrivals:
            for request in arrivals.pop(0):
                scheduler.add(request)
                added.append(request)
        if step in cancel_at and added:
            victim = added[cancel_at[step] % len(added)]
            if scheduler.cancel(victim):
                cancelled.append(victim)
        idle = driver.step()
        if idle and not arrivals and not scheduler.waiting and not scheduler.running:
            return cancelled
    raise AssertionError("the scheduler stopped making progress")


def check_outputs(requests: list[Request], cancelled: list[Request], eos_every: int, context_len: int) -> None:
    for request in requests:
        expected = expected_tokens(
            request.prompt_ids, request.max_tokens, eos_every=eos_every,
            stop_token_ids=request.stop_token_ids, context_len=context_len,
        )
        output = request.token_ids[request.num_prompt :]
        if request in cancelled:
            assert request.finish_reason is FinishReason.CANCELLED
            assert output == expected[: len(output)], request.request_id
        else:
            assert output == expected, request.request_id
            assert request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_tokens_planned_ahead_are_referred_to_and_late_endings_discard_their_work() -> None:
    """A mixed load in a pool small enough to retract: every kind of ending happens while the
    next step is already out, and nothing of that step's work survives."""
    rng = random.Random(7)
    num_pages, context_len, eos_every = 24, 60, 9
    prefix = [rng.randrange(3, 64) for _ in range(10)]
    requests = [
        Request(
            request_id=f"r{index}",
            prompt_ids=prefix[: rng.randrange(0, 11)] + [rng.randrange(3, 64) for _ in range(rng.randrange(1, 20))],
            max_tokens=rng.randrange(1, 40),
            stop_token_ids=frozenset(rng.sample(range(3, 64), rng.choice([0, 2]))),
        )
        for index in range(40)
    ]
    model = FakeModel(num_pages, PAGE_SIZE, eos_every)
    driver = LookaheadDriver(scheduler_for(num_pages, context_len), model)
    cancelled = run(driver, [requests[i : i + 4] for i in range(0, len(requests), 4)],
                    cancel_at={5: 1, 9: 6, 17: 11, 30: 20, 41: 33})
    check_outputs(requests, cancelled, eos_every, context_len)
    assert cancelled
    assert driver.num_referred > 100  # decodes really ran one step ahead
    assert driver.num_stale > 0  # and some of them were for requests that had just ended
    assert driver.scheduler.stats.num_retractions > 0
    assert {r.finish_reason for r in requests} >= {FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED}
    check_no_leak(driver.scheduler, num_pages)


def test_a_request_whose_token_in_flight_is_its_last_gets_no_more_work() -> None:
    """max_tokens=1: its prefill samples its only token; nothing is planned behind it, so a
    pool that holds exactly its prompt is enough."""
    prompt = list(range(3, 3 + 2 * PAGE_SIZE))
    scheduler = scheduler_for(2, 1 << 20)
    driver = LookaheadDriver(scheduler, FakeModel(2, PAGE_SIZE))
    request = Request(request_id="one", prompt_ids=prompt, max_tokens=1)
    run(driver, [[request]], {})
    assert request.token_ids[len(prompt):] == expected_tokens(prompt, 1, eos_every=0)
    assert driver.num_referred == 0 and driver.num_stale == 0
    check_no_leak(scheduler, 2)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[int, int, int, list[list[Request]], dict[int, int]]:
    num_pages = draw(st.integers(2, 16))
    slots = num_pages * PAGE_SIZE
    context_len = draw(st.sampled_from([slots + 4, 1 << 20]))
    eos_every = draw(st.sampled_from([0, 5]))
    prefix = draw(st.lists(st.integers(3, 63), max_size=slots))
    batches: list[list[Request]] = []
    for batch_index in range(draw(st.integers(1, 5))):
        batch = []
        for index in range(draw(st.integers(0, 4))):
            prompt_len = draw(st.integers(1, slots // 2))
            shared = draw(st.integers(0, min(prompt_len, len(prefix))))
            tail = draw(st.lists(st.integers(3, 63), min_size=prompt_len - shared,
                                 max_size=prompt_len - shared))
            batch.append(Request(
                request_id=f"r{batch_index}.{index}", prompt_ids=prefix[:shared] + tail,
                max_tokens=draw(st.integers(1, slots - prompt_len + 1)),
                stop_token_ids=frozenset(draw(st.lists(st.integers(3, 63), max_size=2))),
            ))
        batches.append(batch)
    cancel_at = draw(st.dictionaries(st.integers(0, 60), st.integers(0, 20), max_size=3))
    return num_pages, context_len, eos_every, batches, cancel_at


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(1, 24), st.booleans())
def test_outputs_and_pages_are_the_same_with_overlap_on_and_off(workload, max_batch_tokens: int, overlap: bool) -> None:
    num_pages, context_len, eos_every, batches, cancel_at = workload
    scheduler = scheduler_for(num_pages, context_len, max_batch_tokens=max_batch_tokens)
    driver = LookaheadDriver(scheduler, FakeModel(num_pages, PAGE_SIZE, eos_every), overlap)
    cancelled = run(driver, batches, cancel_at)
    check_outputs([r for batch in batches for r in batch], cancelled, eos_every, context_len)
    if not overlap:
        assert driver.num_referred == driver.num_stale == 0
    check_no_leak(scheduler, num_pages)
