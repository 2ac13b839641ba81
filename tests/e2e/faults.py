"""Helpers for fault tests on a launched stack: greedy calls, a stream that records how it
ended, and bounded waits on health."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from procs import is_serving
from radixserve.v1 import generation_pb2 as pb
from radixserve.v1 import generation_pb2_grpc

PROMPT = "The capital of France is"


def greedy(address: str, max_tokens: int = 12, timeout_s: float = 30.0, prompt: str = PROMPT) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                                     sampling=pb.SamplingParams(temperature=0))
        return [t for response in stub.Generate(request, timeout=timeout_s) for t in response.token_ids]


def wait_until(predicate, timeout_s: float, interval_s: float = 0.2) -> float:
    """Seconds until `predicate()` held; raises TimeoutError after `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"not true after {timeout_s}s")
        time.sleep(interval_s)
    return time.monotonic() - start


def serves(address: str) -> bool:
    """SERVING and a greedy call goes through."""
    if not is_serving(address):
        return False
    try:
        greedy(address, max_tokens=2, timeout_s=10)
    except grpc.RpcError:
        return False
    return True


@dataclass
class RecordedStream:
    """A Generate stream read on a thread: its tokens, how it ended and when."""

    address: str
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    code: grpc.StatusCode | None = None
    finish_reason: int = 0
    ended_at: float = 0.0
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def start(self, timeout_s: float = 120.0) -> RecordedStream:
        threading.Thread(target=self._read, args=(timeout_s,), daemon=True).start()
        return self

    def _read(self, timeout_s: float) -> None:
        request = pb.GenerateRequest(prompt=PROMPT, max_tokens=self.max_tokens, ignore_eos=True,
                                     sampling=pb.SamplingParams(temperature=0))
        try:
            with grpc.insecure_channel(self.address) as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                for response in stub.Generate(request, timeout=timeout_s):
                    self.token_ids.extend(response.token_ids)
                    self.finish_reason = response.finish_reason or self.finish_reason
                    if self.token_ids:
                        self.started.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code = exc.code()
        finally:
            self.ended_at = time.monotonic()
            self.started.set()
            self.done.set()
