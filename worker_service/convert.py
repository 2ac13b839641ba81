"""Worker protobuf messages <-> the executor's dataclasses; the only module that reads worker protos."""

from __future__ import annotations

from radixserve import constraints, sampling
from radixserve.v1 import generation_pb2, worker_pb2
from worker_service.executor import NewRequest, Task, TaskEntry, TaskResult
from worker_service.forward_batch import ModelInfo


def task_from_proto(message: worker_pb2.DecodeTask) -> Task:
    entries = []
    for entry in message.entries:
        new_request = None
        if entry.HasField("new_request"):
            new_request = NewRequest(
                sampling=sampling.from_proto(entry.new_request.sampling),
                cached_token_ids=list(entry.new_request.cached_token_ids),
                num_prompt_tokens=entry.new_request.num_prompt_tokens,
                constraint=constraints.from_proto(entry.new_request.constraint),
            )
        entries.append(
            TaskEntry(
                request_id=entry.request_id,
                token_ids=list(entry.token_ids),
                start_position=entry.start_position,
                page_ids=list(entry.page_ids),
                sample=entry.sample,
                new_request=new_request,
            )
        )
    return Task(
        task_id=message.task_id,
        entries=entries,
        reset=message.reset,
        release_request_ids=list(message.release_request_ids),
    )


def result_to_proto(result: TaskResult) -> worker_pb2.TaskResult:
    message = worker_pb2.TaskResult(task_id=result.task_id, rank=result.rank)
    for token in result.tokens:
        sampled = message.tokens.add(request_id=token.request_id, token_id=token.token_id)
        if token.logprob is not None:
            sampled.logprob = token.logprob
        for token_id, logprob in token.top_logprobs or []:
            sampled.top_logprobs.append(generation_pb2.TopLogprob(token_id=token_id, logprob=logprob))
    if result.error is not None:
        message.error.code = result.error.code
        message.error.message = result.error.message
    return message


def info_to_proto(info: ModelInfo) -> worker_pb2.GetWorkerInfoResponse:
    return worker_pb2.GetWorkerInfoResponse(
        rank=info.rank,
        world_size=info.world_size,
        model_name=info.model_name,
        dtype=info.dtype,
        page_size=info.page_size,
        num_pages=info.num_pages,
        context_len=info.context_len,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        device=info.device,
    )
