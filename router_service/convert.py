"""Protobuf <-> router values, both ways, and every error's gRPC status: the only place where
the router's core meets the wire format."""

from __future__ import annotations

import grpc

from radixserve import constraints, sampling
from radixserve.sampling import SamplingParams
from radixserve.v1 import generation_pb2, router_pb2, worker_pb2
from router_service.core.request import FinishReason, Pooling, Request
from router_service.core.scheduler import Scheduler
from router_service.core.stats import SchedulerStats
from router_service.core.step_costs import StepCosts
from router_service.core.step_plan import StepPlan
from router_service.errors import InvalidRequest, QueueFull, RouterError, WorkersUnavailable

_STATUS: dict[type[RouterError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    WorkersUnavailable: grpc.StatusCode.UNAVAILABLE,
}

_POOLING = {
    worker_pb2.POOLING_MODE_LAST: Pooling.LAST,
    worker_pb2.POOLING_MODE_MEAN: Pooling.MEAN,
}
_POOLING_MODE = {pooling: mode for mode, pooling in _POOLING.items()}

_FINISH = {
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: generation_pb2.FINISH_REASON_CANCELLED,
}


def status_of(error: RouterError) -> tuple[grpc.StatusCode, str]:
    for kind in type(error).__mro__:
        if kind in _STATUS:
            return _STATUS[kind], str(error)
    return grpc.StatusCode.INTERNAL, str(error)


def _check_request_id(request_id: str, max_request_id_bytes: int) -> None:
    num_id_bytes = len(request_id.encode())
    if num_id_bytes > max_request_id_bytes:
        raise InvalidRequest(
            f"request_id of {num_id_bytes} bytes is longer than {max_request_id_bytes}"
        )


def embed_request_from_proto(msg: router_pb2.RouterEmbedRequest, max_request_id_bytes: int) -> Request:
    """An embedding `Request` (one "output": the vector); raises `InvalidRequest`."""
    _check_request_id(msg.request_id, max_request_id_bytes)
    if not msg.prompt_token_ids:
        raise InvalidRequest("the prompt is empty")
    if msg.pooling.mode not in _POOLING:
        raise InvalidRequest(f"pooling mode must be LAST or MEAN, got {msg.pooling.mode}")
    return Request(
        request_id=msg.request_id,
        prompt_ids=list(msg.prompt_token_ids),
        max_tokens=1,
        pooling=_POOLING[msg.pooling.mode],
        normalize=msg.pooling.normalize,
    )


def embed_response_to_proto(embedding: list[float], request: Request) -> router_pb2.RouterEmbedResponse:
    response = router_pb2.RouterEmbedResponse(embedding=embedding)
    response.usage.prompt_tokens = request.num_prompt
    response.usage.cached_tokens = max(request.num_cached_tokens, 0)
    return response


def request_from_proto(msg: router_pb2.RouterGenerateRequest, max_request_id_bytes: int) -> Request:
    """A `Request` from the wire; raises `InvalidRequest` for what can never be served.

    Everything the workers will see is checked here or by the engine (limits that depend on
    the workers: vocabulary, context, pool), so that a rank rejects a task only for a router
    bug. The sampling ranges are `SamplingParams.problems`, the workers' own rules.
    """
    _check_request_id(msg.request_id, max_request_id_bytes)
    if not msg.prompt_token_ids:
        raise InvalidRequest("the prompt is empty")
    if msg.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be >= 1, got {msg.max_tokens}")
    # An unset sampling message means greedy with everything off, not all-zero penalties.
    params = sampling.from_proto(msg.sampling) if msg.HasField("sampling") else SamplingParams()
    problems = params.problems()
    if problems:
        raise InvalidRequest(f"sampling: {'; '.join(problems)}")
    constraint = constraints.from_proto(msg.constraint)
    if constraint is not None and constraint.problems():
        raise InvalidRequest("; ".join(constraint.problems()))
    return Request(
        request_id=msg.request_id,
        prompt_ids=list(msg.prompt_token_ids),
        max_tokens=msg.max_tokens,
        sampling=params,
        stop_token_ids=frozenset(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        constraint=constraint,
    )


def task_to_proto(plan: StepPlan, task_id: int, previous_task_id: int) -> worker_pb2.DecodeTask:
    """`previous_task_id`: the task sent just before, whose sampled tokens entries planned
    ahead of its result refer to."""
    task = worker_pb2.DecodeTask(task_id=task_id, release_request_ids=plan.release_request_ids)
    add = task.entries.add
    for entry in plan.entries:
        request = entry.request
        # Fields set one by one, and only where not proto3's default: keyword arguments to `add`
        # cost several times as much per entry, on the path of every step.
        task_entry = add()
        task_entry.request_id = request.request_id
        if entry.token_ids:
            task_entry.token_ids.extend(entry.token_ids)
        task_entry.start_position = entry.start_position
        if entry.new_page_ids:
            task_entry.page_ids.extend(entry.new_page_ids)
        if entry.sample:
            task_entry.sample = True
        if entry.after_sampled:
            task_entry.sampled_in_task = previous_task_id
        if entry.num_draft_tokens:
            task_entry.num_draft_tokens = entry.num_draft_tokens
        if entry.new_request:
            task_entry.new_request.CopyFrom(worker_pb2.NewRequest(
                sampling=sampling.to_proto(request.sampling),
                cached_token_ids=entry.cached_token_ids,
                num_prompt_tokens=request.num_prompt,
                constraint=constraints.to_proto(request.constraint),
            ))
            if request.pooling is not None:
                pooling = task_entry.new_request.pooling
                pooling.mode, pooling.normalize = _POOLING_MODE[request.pooling], request.normalize
    return task


def stats_to_proto(
    stats: SchedulerStats, scheduler: Scheduler | None, costs: StepCosts
) -> router_pb2.GetStatsResponse:
    """GetStats' answer (also what the metrics read, through `Engine.stats`): counters, step
    costs, and the scheduler's state while the workers are connected."""
    idle, cpu = costs.worker_idle.stats(), costs.router_cpu.stats()
    response = router_pb2.GetStatsResponse(
        cache_hit_tokens=stats.cache_hit_tokens,
        prompt_tokens=stats.prompt_tokens,
        num_steps=stats.num_steps,
        num_retractions=stats.num_retractions,
        worker_idle_p50_s=idle.p50_s,
        worker_idle_s_total=idle.total_s,
        num_idle_measured_steps=idle.num_steps,
        router_step_cpu_p50_s=cpu.p50_s,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_draft_tokens=stats.num_accepted_draft_tokens,
        num_draft_entries=stats.num_draft_entries,
    )
    if scheduler is not None:
        allocator = scheduler.allocator
        response.num_running = scheduler.num_running
        response.num_waiting = scheduler.num_waiting
        response.num_pages_total = allocator.num_pages
        response.num_pages_free = allocator.num_free
        response.num_pages_used = allocator.num_used
        response.num_pages_evictable = scheduler.cache.evictable_size
    return response


def load_to_proto(scheduler: Scheduler | None, costs: StepCosts) -> router_pb2.RouterLoad:
    """The router's load as Stream messages carry it; all zero while the workers are away."""
    if scheduler is None:
        return router_pb2.RouterLoad()
    allocator = scheduler.allocator
    return router_pb2.RouterLoad(
        num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
        num_pages_free=allocator.num_free, num_pages_total=allocator.num_pages,
        step_time_s=costs.step_time_s,
    )


def step_logprobs(sampled: worker_pb2.SampledToken, num_new: int) -> list[generation_pb2.TokenLogprob]:
    """The logprobs of a step's `num_new` output tokens: accepted drafts first, then the
    sampled token (left out when a draft ended the request)."""
    last = generation_pb2.TokenLogprob(
        token_id=sampled.token_id, logprob=sampled.logprob, top_logprobs=sampled.top_logprobs
    )
    return [*sampled.accepted_logprobs, last][:num_new]


UsageCounts = tuple[int, int, int]
"""What a response reports of its request's progress: (num_output, draft tokens, accepted draft
tokens); the rest of its usage never changes while the request runs."""


def usage_counts(request: Request) -> UsageCounts:
    draft = request.draft
    return request.num_output, draft.num_drafted, draft.num_accepted


def response_to_proto(
    token_ids: list[int],
    logprobs: list[generation_pb2.TokenLogprob],
    request: Request,
    finished: bool,
    into: router_pb2.RouterGenerateResponse | None = None,
    counts: UsageCounts | None = None,
) -> router_pb2.RouterGenerateResponse:
    """The response for new tokens, written into `into` (an empty message, such as a Stream
    update's own field, so that nothing is built twice) or a new one. `counts`: the request's
    `usage_counts` when the tokens came (None: now)."""
    response = router_pb2.RouterGenerateResponse() if into is None else into
    response.token_ids.extend(token_ids)
    if logprobs:
        response.logprobs.extend(logprobs)
    num_output, num_drafted, num_accepted = usage_counts(request) if counts is None else counts
    # Usage rides on every response, so a caller that stops reading early (the gateway, on a
    # stop string) still knows the prompt's cached tokens. (Zeros are proto3's default: the
    # fields that are zero, as most are for a plain request, are left unset, which reads the same.)
    usage = response.usage
    usage.prompt_tokens = request.num_prompt
    usage.completion_tokens = num_output
    if request.num_cached_tokens > 0:
        usage.cached_tokens = request.num_cached_tokens
    if num_drafted:
        usage.draft_tokens = num_drafted
        usage.accepted_draft_tokens = num_accepted
    if finished and request.finish_reason in _FINISH:
        response.finish_reason = _FINISH[request.finish_reason]
    return response
