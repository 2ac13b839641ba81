"""The engine: connects to the worker group and runs the scheduler, one step at a time.

Each step the scheduler plans a batch; the engine turns it into one `DecodeTask` that carries
only what changed (new tokens, new pages, `new_request` on a request's first entry, releases),
sends it to every rank, applies rank 0's sampled tokens and streams them to the requests'
callers. With `overlap` on (the default unless the workers run on the CPU, see
`RouterConfig.overlap`) the next step is planned and sent while the workers run the current one
(see `lookahead`). When any rank fails or misses the step deadline (`step_timeout_s`, counted
for each step from when the engine starts waiting for it: after the step before it), every
request ends with UNAVAILABLE, health goes NOT_SERVING and the engine reconnects every
`reconnect_interval_s`; a new connection starts with `reset=True` and an empty cache (the
workers' K/V can no longer be trusted). A task that every rank rejected (nothing applied) fails
only its own requests (and those of the step sent on top of it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from radixserve.sampling import logit_bias_problems
from radixserve.security import Security
from radixserve.serving import NO_SECURITY
from radixserve.v1 import router_pb2, worker_pb2
from router_service import convert
from router_service.config import RouterConfig
from router_service.core.request import FinishReason, Request
from router_service.core.scheduler import Scheduler
from router_service.core.stats import SchedulerStats
from router_service.core.step_costs import StepCosts
from router_service.errors import ConstraintFailed, InvalidRequest, QueueFull, RouterError, WorkersUnavailable
from router_service.events import EventSink, StreamEvent
from router_service.lookahead import InFlightStep
from router_service.metrics import RouterMetrics
from router_service.worker_group import TaskRejected, WorkerFault, WorkerGroup
from router_service.workers_info import resolve_overlap, summarize

log = logging.getLogger(__name__)


class Engine:
    """Owns the scheduler and the worker connection; everything runs on one asyncio loop.

    The service calls `submit` / `cancel` / `stats` (never blocking); `run` is the step loop.
    A request's events go to the sink given to `submit` (Generate's queue, or a Stream call's);
    its last event is `finished` or carries an `error`. The scheduler exists only while the
    workers are connected.
    """

    def __init__(
        self,
        config: RouterConfig,
        on_health: Callable[[bool], Awaitable[None]] | None = None,
        security: Security = NO_SECURITY,
    ) -> None:
        self.config = config
        self.group = WorkerGroup(config.workers, config.connect_timeout_s, security)
        # What the router serves, as learned from the workers at connection time (GetServerInfo).
        self.summary: router_pb2.GetServerInfoResponse | None = None
        self.scheduler: Scheduler | None = None
        # `config.overlap` resolved for the workers connected (see `resolve_overlap`).
        self.overlap = bool(config.overlap)
        self._on_health = on_health
        self._streams: dict[str, EventSink] = {}
        # Events not yet handed to their callers (see `_flush`): each a sink's method (put_nowait,
        # put_token) and its argument.
        self._outbox: list[tuple[Callable[[Any], None], StreamEvent | int]] = []
        self._cancelled: list[Request] = []
        # Tasks sent whose results are not back, oldest first: at most two (one ahead).
        self._in_flight: list[InFlightStep] = []
        self._last_task_id = 0
        # Whether the last step was sent with no idle wait since: the next one is back to back.
        self._busy = False
        self.costs = StepCosts()
        self._last_result_at = 0.0  # time.monotonic() when the last step's result came back
        self._wakeup = asyncio.Event()
        self._request_ids = itertools.count()
        self._task_ids = itertools.count(1)
        # Counters of schedulers dropped at reconnects, so that GetStats never goes backwards.
        self._past = SchedulerStats()
        self._last_connect_error = ""
        self.metrics = RouterMetrics(self)

    # ---- called by the service -----------------------------------------------------------

    def submit(self, request: Request, sink: EventSink) -> None:
        """Queue a request whose events go to `sink`. Raises `RouterError`."""
        scheduler, summary = self.scheduler, self.summary
        if scheduler is None or summary is None:
            raise WorkersUnavailable("the workers are not connected")
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= summary.vocab_size:
            raise InvalidRequest(f"token ids must be in [0, {summary.vocab_size})")
        bias_problems = logit_bias_problems(request.sampling.logit_bias, summary.vocab_size)
        if bias_problems:
            raise InvalidRequest("; ".join(bias_problems))
        if scheduler.num_waiting >= self.config.max_queue:
            raise QueueFull(f"{scheduler.num_waiting} requests are already waiting")
        # Worker-side ids must be unique; the caller's id stays readable in the workers' logs.
        request.request_id = f"{request.request_id or 'req'}#{next(self._request_ids)}"
        scheduler.add(request)
        self.metrics.submitted(request.request_id)
        self._streams[request.request_id] = sink
        self._wakeup.set()

    def cancel(self, request: Request) -> None:
        """The caller went away: take the request out within one step."""
        if self._streams.pop(request.request_id, None) is None:
            return  # already ended
        self.metrics.ended(request.request_id)
        if self._in_flight:
            self._cancelled.append(request)  # a task that names it is in flight
        elif self.scheduler is not None:
            self.scheduler.cancel(request)
        self._wakeup.set()

    def load(self) -> router_pb2.RouterLoad:
        """The load reported on every Stream message (gateways route by it)."""
        return convert.load_to_proto(self.scheduler, self.costs)

    def stats(self) -> router_pb2.GetStatsResponse:
        """GetStats' answer, which the metrics also read: the one conversion of the counters."""
        return convert.stats_to_proto(self._counters(), self.scheduler, self.costs)

    @property
    def model_name(self) -> str:
        return self.summary.model.model_name if self.summary is not None else ""

    def _counters(self) -> SchedulerStats:
        return self._past + (self.scheduler.stats if self.scheduler else SchedulerStats())

    # ---- the loop ------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.scheduler is None:
                if not await self._connect():
                    await _wait_any(stop.wait(), timeout_s=self.config.reconnect_interval_s)
                continue
            try:
                await self._step(stop)
            except WorkerFault as exc:
                await self._fail(WorkersUnavailable(f"a worker failed: {exc}"))
            except Exception:  # a router bug: fail what is in flight, start over, keep serving
                log.exception("engine step failed")
                await self._fail(RouterError("internal error in the router"))
        self._flush()
        await self.group.close()

    async def _connect(self) -> bool:
        try:
            infos = await self.group.connect()
            # The first task on a new connection makes every rank forget old requests.
            reset = worker_pb2.DecodeTask(task_id=next(self._task_ids), reset=True)
            try:
                await self.group.execute(reset, self.config.step_timeout_s)
                self._last_task_id = reset.task_id
            except TaskRejected as exc:
                raise WorkerFault(str(exc)) from exc
        except WorkerFault as exc:
            # Once per distinct reason: the attempt repeats every reconnect interval.
            if str(exc) != self._last_connect_error:
                # Workers still starting beside a new router are the normal case, not a fault.
                level = logging.WARNING if self.summary is not None else logging.INFO
                log.log(level, "workers not ready (retrying every %.1fs): %s",
                        self.config.reconnect_interval_s, exc)
                self._last_connect_error = str(exc)
            await self.group.close()
            return False
        self._last_connect_error = ""
        self.metrics.connected()
        self.summary = summarize(infos, self.config.max_pages, self.config.served_model_name)
        self.overlap = resolve_overlap(self.config.overlap, infos)
        self.scheduler = Scheduler(
            num_pages=self.summary.model.num_pages,
            page_size=self.summary.model.page_size,
            max_batch_tokens=self.config.max_batch_tokens,
            max_running_requests=self.config.max_running_requests,
            policy=self.config.policy,
            context_len=self.summary.model.context_len,
            eos_token_ids=frozenset(self.summary.eos_token_ids),
            speculation=self.config.speculation,
        )
        log.info("serving %s over %d rank(s) on %s, %d pages of %d tokens, overlap scheduling %s",
                 self.summary.model.model_name, len(infos), infos[0].device or "an unnamed device",
                 self.summary.model.num_pages, self.summary.model.page_size, "on" if self.overlap else "off")
        await self._set_health(True)
        return True

    async def _step(self, stop: asyncio.Event) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        if self.group.broken.is_set():
            raise WorkerFault("a worker stream ended")
        ahead = self._in_flight[-1] if self._in_flight else None
        if ahead is not None and not ahead.may_run_ahead(self.overlap):
            self._flush()
            await self._finish_oldest()
            return
        started = time.monotonic()
        cpu_started = time.thread_time()
        for request in self._cancelled:
            scheduler.cancel(request)
        self._cancelled.clear()
        plan = scheduler.schedule()
        self._send_ended(plan.ended)
        if not plan.sends_task:
            self._flush()
            if ahead is not None:
                await self._finish_oldest()  # then plan again, with its tokens
            elif plan.is_empty:
                await self._idle(stop)
            return
        task = convert.task_to_proto(plan, next(self._task_ids), self._last_task_id)
        flight = InFlightStep(plan, task, started, time.thread_time() - cpu_started, self._busy)
        # The last step's tokens go to their callers now, but their writes run only once the
        # send below has handed the task to grpc (awaiting it runs it up to there): the task goes
        # to the workers first, and the callers' writes fill the wait for its send to complete,
        # instead of the loop sleeping through it and waking again (a thread switch per step).
        self._flush()
        await self.group.send(task, self.config.step_timeout_s)
        self._last_task_id = task.task_id
        self._in_flight.append(flight)
        self._busy = True
        if ahead is not None:
            # The workers run `task` right after `ahead`: apply ahead's tokens meanwhile.
            await self._finish_oldest()
        if not flight.may_run_ahead(self.overlap) and flight in self._in_flight:
            await self._finish_oldest()

    async def _idle(self, stop: asyncio.Event) -> None:
        """Nothing to run and nothing in flight: check the bookkeeping, wait for work."""
        scheduler = self.scheduler
        assert scheduler is not None
        # The moment to check the scheduler's bookkeeping whole (see `PageManager.audit`).
        failed = scheduler.audit_when_idle()
        if failed:
            self._send_ended(failed)
            return  # their releases go with the next step
        self.costs.end_busy_period(self.overlap)
        self._busy = False
        self._wakeup.clear()  # nothing to do until a request arrives or leaves
        await _wait_any(self._wakeup.wait(), self.group.broken.wait(), stop.wait())

    async def _finish_oldest(self) -> None:
        """Wait for the oldest task in flight (at most `step_timeout_s`) and apply its tokens."""
        scheduler = self.scheduler
        assert scheduler is not None
        flight = self._in_flight[0]
        try:
            result = await self.group.receive(flight.task, self.config.step_timeout_s)
        except TaskRejected as exc:
            # The router validates all it sends, so this is a router bug; contain it to the
            # requests of this task and of the one sent on top of it (which refers to its
            # tokens): no rank applied the first, the rest is as it was.
            later, self._in_flight = self._in_flight[1:], []
            log.error("BUG: %s; failing its %d request(s)", exc, len(flight.plan.entries))
            failed = scheduler.fail_step(flight.plan)
            for step in later:
                try:
                    await self.group.receive(step.task, self.config.step_timeout_s)
                except TaskRejected:
                    pass  # refused for want of the first one's tokens: nothing applied
                failed += scheduler.fail_step(step.plan)
            self._send_ended(failed)
            return
        cpu_started = time.thread_time()
        self._in_flight.pop(0)
        plan = flight.plan
        sampling = plan.sampling
        tokens = result.tokens
        if len(tokens) != len(sampling):
            raise WorkerFault(f"rank 0 sampled {len(tokens)} tokens for task {flight.task.task_id}'s "
                              f"{len(sampling)} sampling requests")
        # One pass over the result's tokens: each read of a proto field costs.
        token_ids: list[int] = []
        num_accepted: list[int] = []
        num_outputs: list[int] = []
        for entry, token in zip(sampling, tokens):
            request = entry.request
            if request.request_id != token.request_id:
                raise WorkerFault(
                    f"rank 0 sampled for other requests than task {flight.task.task_id} asked"
                )
            token_ids.append(token.token_id)
            num_accepted.append(token.num_accepted_drafts)
            num_outputs.append(request.num_output)
        self.metrics.step(plan, flight.started)
        now = time.monotonic()
        seconds = now - max(flight.started, self._last_result_at)
        self.costs.step_time(seconds)
        scheduler.observe_step(plan, seconds)  # what drafts cost (core/speculation.py)
        self._last_result_at = now
        scheduler.complete(plan, token_ids, num_accepted)
        # Rare: read once per step, not per token.
        failures = {failure.request_id: failure.message for failure in result.constraint_failures} \
            if result.constraint_failures else None
        for entry, token, num_output in zip(sampling, tokens, num_outputs):
            request = entry.request
            if failures is not None and request.request_id in failures:
                scheduler.cancel(request)  # still running: it ends now, its pages given back
                self._send(request, StreamEvent(error=ConstraintFailed(
                    f"constraint: the output could not follow it past output token {request.num_output} "
                    f"({failures[request.request_id]})")))
                continue
            # A step yields the accepted drafts and the sampled token, up to a stop; a stale
            # entry (`complete` skipped it) yields nothing.
            num_new = request.num_output - num_output
            if not num_new:
                continue
            if request.pooling is not None:  # its one "token" is the vector
                self._send(request, StreamEvent(finished=True, embedding=list(token.embedding)))
                continue
            if num_new == 1 and request.finish_reason is None and not request.sampling.logprobs:
                queue = self._streams.get(request.request_id)
                if queue is not None:  # else: cancelled while its step was in flight
                    self._outbox.append((queue.put_token, request.token_ids[-1]))
                continue
            logprobs = convert.step_logprobs(token, num_new) if request.sampling.logprobs else []
            self._send(request, StreamEvent(
                request.token_ids[-num_new:], logprobs, finished=request.finish_reason is not None,
            ))
        cpu_s = flight.plan_cpu_s + time.thread_time() - cpu_started
        idle_s = result.idle_before_s if flight.back_to_back else None
        self.costs.step_done(cpu_s, idle_s)
        self.metrics.step_costs(cpu_s, idle_s)

    def _send_ended(self, requests: list[Request]) -> None:
        """Tell the callers of requests the scheduler ended while planning."""
        for request in requests:
            if request.finish_reason is FinishReason.FAILED:  # a router bug, contained
                self._send(request, StreamEvent(error=RouterError("internal error in the router")))
            else:
                self._send(request, StreamEvent(finished=True))

    def _send(self, request: Request, event: StreamEvent) -> None:
        """Queue `event` for the request's caller; it is handed over at the next `_flush`."""
        queue = self._streams.get(request.request_id)
        if queue is None:
            return  # cancelled while its step was in flight
        self._outbox.append((queue.put_nowait, event))
        if event.finished or event.error:
            del self._streams[request.request_id]
            self.metrics.ended(request.request_id)

    def _flush(self) -> None:
        """Hand the queued events to their callers, in order. Each wakes a caller's stream, which
        writes to the gateway when the loop next runs it: the step loop flushes as it sends a
        task, or before it waits with none sent. Callers only take the event here (a Stream
        call builds its message when it writes): this runs before a task's send."""
        outbox, self._outbox = self._outbox, []
        for put, item in outbox:
            put(item)

    async def _fail(self, error: RouterError) -> None:
        """End every request with `error` and drop the connection (it reconnects and resets)."""
        log.error("failing all requests: %s", error)
        await self._set_health(False)
        self._past = self._counters()
        scheduler = self.scheduler
        self.scheduler = None
        if scheduler is not None:
            for request in scheduler.fail_all():
                self._send(request, StreamEvent(error=error))
        self._flush()
        self._cancelled.clear()
        self._in_flight.clear()
        self._busy = False
        await self.group.close()

    async def _set_health(self, serving: bool) -> None:
        if self._on_health is not None:
            await self._on_health(serving)


async def _wait_any(*waits: Awaitable[object], timeout_s: float | None = None) -> None:
    """Return when the first of `waits` finishes (or after `timeout_s`); cancel the rest."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
