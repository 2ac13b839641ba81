"""Real `python -m worker_service` processes with SmolLM2: TP=1 against transformers, TP=2 against TP=1.

Each test starts its workers through `tests/procs.py`, so they are killed whatever happens.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from procs import PYTHON, ServiceProcesses, free_port
from radixserve.serving import CHANNEL_OPTIONS, start_server
from radixserve.v1 import worker_pb2, worker_pb2_grpc
from worker.executor_fakes import FakeRunner
from worker_service.config import parse_config
from worker_service.executor import Executor
from worker_service.service import SERVICE_NAME, WorkerService

PROMPT = "The capital of France is"
NUM_NEW_TOKENS = 6
PAGE_SIZE = 4
# Pages handed out in a scrambled order: results must not depend on which pages a request gets.
PAGES = [11, 3, 27, 8, 19, 1, 14]
KV_CACHE_MB = 16
RPC_TIMEOUT_S = 120.0
READY_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def prompt_and_reference(smollm2_dir: Path) -> tuple[list[int], list[int], list[float]]:
    """The prompt's token ids, transformers' greedy continuation and each token's logprob."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(smollm2_dir)(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids, tokens, logprobs = list(prompt), [], []
    with torch.inference_mode():
        for _ in range(NUM_NEW_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            ids.append(token)
    return prompt, tokens, logprobs


class TaskStream:
    """One Execute stream driven one task at a time (the next task depends on the last token)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self._outbox: queue.Queue[worker_pb2.DecodeTask | None] = queue.Queue()
        self._results: Iterator[worker_pb2.TaskResult] = self.stub.Execute(
            iter(self._outbox.get, None), timeout=RPC_TIMEOUT_S * 2
        )

    def info(self) -> worker_pb2.GetWorkerInfoResponse:
        return self.stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=RPC_TIMEOUT_S)

    def send(self, task: worker_pb2.DecodeTask) -> None:
        self._outbox.put(task)

    def receive(self) -> worker_pb2.TaskResult:
        return next(self._results)

    def close(self) -> None:
        self._outbox.put(None)
        self.channel.close()


def start_worker(
    procs: ServiceProcesses, model: Path, rank: int = 0, world_size: int = 1, master_port: int = 0
) -> str:
    port = free_port()
    procs.start(
        f"worker{rank}",
        [PYTHON, "-m", "worker_service", "--model", str(model), "--port", str(port),
         "--page-size", str(PAGE_SIZE), "--kv-cache-mb", str(KV_CACHE_MB), "--num-threads", "1",
         "--device", "cpu", "--dtype", "float32"],
        env={"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(master_port or free_port())},
    )
    return f"127.0.0.1:{port}"


def prefill(task_id: int, prompt: list[int]) -> worker_pb2.DecodeTask:
    num_pages = -(-(len(prompt) + NUM_NEW_TOKENS) // PAGE_SIZE)
    sampling = worker_pb2.ResolvedSamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0, logprobs=True)
    entry = worker_pb2.TaskEntry(
        request_id="r", token_ids=prompt, start_position=0, page_ids=PAGES[:num_pages], sample=True,
        new_request=worker_pb2.NewRequest(sampling=sampling, num_prompt_tokens=len(prompt)),
    )
    return worker_pb2.DecodeTask(task_id=task_id, reset=True, entries=[entry])


def decode(task_id: int, token: int, position: int, request_id: str = "r") -> worker_pb2.DecodeTask:
    entry = worker_pb2.TaskEntry(request_id=request_id, token_ids=[token], start_position=position, sample=True)
    return worker_pb2.DecodeTask(task_id=task_id, entries=[entry])


def generate(streams: list[TaskStream], prompt: list[int], num_pages: int) -> list[list[worker_pb2.TaskResult]]:
    """Prefill and decode on every rank, with malformed tasks in between; results per rank."""
    results: list[list[worker_pb2.TaskResult]] = [[] for _ in streams]
    bad_tasks = {
        1: (decode(0, 5, 0, request_id="ghost"), "unknown request id"),
        3: (worker_pb2.DecodeTask(entries=[worker_pb2.TaskEntry(
            request_id="r", token_ids=[5], start_position=len(prompt) + 3, page_ids=[num_pages], sample=True)]),
            f"page id {num_pages} is outside [0, {num_pages})"),
        4: (decode(0, 5, len(prompt) + 1), "does not follow the KV written"),
    }
    task_id, token, position = 1, None, 0
    for step in range(NUM_NEW_TOKENS):
        task = prefill(task_id, prompt) if step == 0 else decode(task_id, token, position)
        for stream in streams:
            stream.send(task)
        for rank, stream in enumerate(streams):
            results[rank].append(stream.receive())
        assert all(r[-1].task_id == task_id and not r[-1].HasField("error") for r in results), results
        token = results[0][-1].tokens[0].token_id
        position = len(prompt) + step
        task_id += 1
        if step in bad_tasks:
            bad, needle = bad_tasks[step]
            bad.task_id = task_id
            for stream in streams:
                stream.send(bad)
            for rank, stream in enumerate(streams):
                rejected = stream.receive()
                assert rejected.task_id == task_id and rejected.rank == rank
                assert rejected.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                assert needle in rejected.error.message, rejected.error.message
                assert not rejected.tokens
            task_id += 1
    return results


@pytest.mark.timeout(300)
def test_tp1_worker_matches_transformers_and_survives_bad_tasks(smollm2_dir: Path, request) -> None:
    with ServiceProcesses() as procs:
        address = start_worker(procs, smollm2_dir)
        # The reference runs while the worker loads.
        prompt, reference, reference_logprobs = request.getfixturevalue("prompt_and_reference")
        procs.wait_healthy(address, timeout_s=READY_TIMEOUT_S)
        stream = TaskStream(address)
        try:
            info = stream.info()
            assert (info.rank, info.world_size, info.page_size, info.dtype) == (0, 1, PAGE_SIZE, "float32")
            assert (info.vocab_size, info.context_len, list(info.eos_token_ids)) == (49152, 8192, [2])
            assert info.model_name == smollm2_dir.name and info.device == "cpu"
            assert info.num_pages > max(PAGES)
            (results,) = generate([stream], prompt, info.num_pages)
        finally:
            stream.close()
        tokens = [result.tokens[0] for result in results]
        assert [t.token_id for t in tokens] == reference
        assert [t.request_id for t in tokens] == ["r"] * NUM_NEW_TOKENS
        assert [t.logprob for t in tokens] == pytest.approx(reference_logprobs, abs=2e-3)
        procs.stop("worker0")
        assert procs.procs["worker0"].returncode == 0, procs.tail("worker0")
        assert "worker ready" in procs.tail("worker0")


@pytest.mark.timeout(300)
def test_tp2_workers_rank0_samples_rank1_acknowledges(smollm2_dir: Path, request) -> None:
    master_port = free_port()
    with ServiceProcesses() as procs:
        addresses = [start_worker(procs, smollm2_dir, rank, 2, master_port) for rank in range(2)]
        prompt, reference, _ = request.getfixturevalue("prompt_and_reference")
        for address in addresses:
            procs.wait_healthy(address, timeout_s=READY_TIMEOUT_S)
        streams = [TaskStream(address) for address in addresses]
        try:
            infos = [stream.info() for stream in streams]
            assert [(i.rank, i.world_size) for i in infos] == [(0, 2), (1, 2)]
            num_pages = min(i.num_pages for i in infos)
            rank0, rank1 = generate(streams, prompt, num_pages)
        finally:
            for stream in streams:
                stream.close()
        assert [result.tokens[0].token_id for result in rank0] == reference
        assert all(result.rank == 1 and not result.tokens for result in rank1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", [0, 1])
def test_not_serving_until_the_group_forms_and_stops_while_waiting(smollm2_dir: Path, rank: int) -> None:
    """Either rank alone waits at the rendezvous; SIGTERM then exits 0 (issue 15 saw a rank
    abort there with "terminate called without an active exception", status 134)."""
    with ServiceProcesses() as procs:
        # One rank of two, alone: it listens at once but waits for the other at the rendezvous.
        address = start_worker(procs, smollm2_dir, rank=rank, world_size=2)
        status = wait_for_health_answer(procs, address)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            with pytest.raises(grpc.RpcError) as raised:
                stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=RPC_TIMEOUT_S)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in raised.value.details()
        name = f"worker{rank}"
        procs.stop(name)
        assert procs.procs[name].returncode == 0, procs.tail(name)


def wait_for_health_answer(procs: ServiceProcesses, address: str) -> int:
    """The first health status the server answers (a refused connection is not an answer)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            procs.check_alive()
            try:
                return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0).status
            except grpc.RpcError:
                time.sleep(0.2)
    raise TimeoutError(f"{address} never answered a health check")


class BlockingRunner(FakeRunner):
    """A fake runner whose forward pass waits until the test lets it finish."""

    def __init__(self) -> None:
        super().__init__(rank=0)
        self.entered = threading.Event()
        self.release = threading.Event()

    def forward(self, entries):
        self.entered.set()
        if not self.release.wait(RPC_TIMEOUT_S):
            raise TimeoutError("the test never released the forward pass")
        return super().forward(entries)


@pytest.mark.timeout(60)
def test_health_and_info_answer_during_a_forward_pass() -> None:
    asyncio.run(_answer_during_forward())


async def _answer_during_forward() -> None:
    service = WorkerService()
    server, health, port = await start_server(
        "127.0.0.1", 0, [lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(service, s)], [SERVICE_NAME]
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            health_stub = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=RPC_TIMEOUT_S)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            runner = BlockingRunner()
            service.attach(Executor(runner))
            await health.set(True)
            call = stub.Execute(timeout=RPC_TIMEOUT_S)
            sampling = worker_pb2.ResolvedSamplingParams(top_p=1.0, repetition_penalty=1.0)
            await call.write(worker_pb2.DecodeTask(task_id=7, entries=[worker_pb2.TaskEntry(
                request_id="r", token_ids=[1, 2, 3], page_ids=[0], sample=True,
                new_request=worker_pb2.NewRequest(sampling=sampling, num_prompt_tokens=3))]))
            assert await asyncio.to_thread(runner.entered.wait, RPC_TIMEOUT_S)
            # The forward pass is still running: the event loop must answer regardless.
            reply = await health_stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=RPC_TIMEOUT_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            info = await stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=RPC_TIMEOUT_S)
            assert info.model_name == "fake" and info.num_pages == runner.info.num_pages
            assert not runner.calls, "the forward pass must still be blocked"
            runner.release.set()
            result = await call.read()
            assert result.task_id == 7 and [t.request_id for t in result.tokens] == ["r"]
            await call.done_writing()
            assert await call.read() == grpc.aio.EOF
    finally:
        await server.stop(0)
        service.close()


def test_config_reads_flags_environment_and_torch_variables() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29999", "RADIXSERVE_PAGE_SIZE": "8"}
    config = parse_config(["--port", "50061", "--log-level", "debug"], env=env)
    assert (config.rank, config.world_size, config.master_port, config.master_addr) == (1, 2, 29999, "127.0.0.1")
    assert (config.page_size, config.port, config.log_level) == (8, 50061, "DEBUG")
    assert parse_config(["--rank", "0"], env={**env, "RADIXSERVE_RANK": "1"}).rank == 0
    with pytest.raises(SystemExit):
        parse_config([], env={"RANK": "2", "WORLD_SIZE": "2"})
