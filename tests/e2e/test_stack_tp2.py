"""The whole system at TP=2 (two gloo worker ranks), started with `radixserve up`: greedy
chat output equals transformers'; a frozen rank fails in-flight requests within the step
deadline and the stack serves again after it resumes; a killed rank's group is restarted by
the launcher; SIGTERM stops every process (last: ends the stack).
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from e2e.faults import RecordedStream, greedy, serves, wait_until
from e2e.parity import check_greedy_parity
from e2e.reference import CHATS
from e2e.stack import launch, wait_gone
from procs import ServiceProcesses, is_serving

# Short deadlines so that faults show within seconds (the defaults are minutes-safe).
STEP_TIMEOUT_S = 6.0
PEER_TIMEOUT_S = 12.0
FAULT_ENV = {
    "RADIXSERVE_STEP_TIMEOUT_S": str(STEP_TIMEOUT_S),
    "RADIXSERVE_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S),
    "RADIXSERVE_COLLECTIVE_TIMEOUT_S": "20",
    "RADIXSERVE_PROBE_INTERVAL_S": "0.5",
    "RADIXSERVE_RECONNECT_INTERVAL_S": "0.5",
}
# The bound for a lost rank: serving again with no action.
HEAL_TIMEOUT_S = 60.0
# Gateway probing (0.5 s) and one health call of slack.
NOT_SERVING_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def stack(smollm2_dir):
    with ServiceProcesses() as procs:
        yield launch(procs, smollm2_dir, tp=2, env=FAULT_ENV)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(CHATS)))
def test_greedy_chat_matches_transformers(stack, references, index):
    check_greedy_parity(stack.gateway, index, references[index])


@pytest.mark.timeout(240)
def test_frozen_rank_fails_in_flight_within_the_step_deadline_then_serves_again(stack):
    before = greedy(stack.gateway)
    worker1 = stack.child_pids()["worker1"]
    stream = RecordedStream(stack.gateway, max_tokens=400).start()
    assert stream.started.wait(60) and stream.code is None
    os.kill(worker1, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        assert stream.done.wait(STEP_TIMEOUT_S + 10)
        assert stream.code == grpc.StatusCode.UNAVAILABLE
        assert stream.ended_at - frozen_at < STEP_TIMEOUT_S + 3
        wait_until(lambda: not is_serving(stack.router), NOT_SERVING_WITHIN_S)
        wait_until(lambda: not is_serving(stack.gateway), NOT_SERVING_WITHIN_S)
    finally:
        os.kill(worker1, signal.SIGCONT)
    resumed_at = time.monotonic()
    wait_until(lambda: serves(stack.gateway), 120, interval_s=0.5)
    print(f"UNAVAILABLE {stream.ended_at - frozen_at:.1f}s after SIGSTOP; serving again "
          f"{time.monotonic() - resumed_at:.1f}s after SIGCONT; group restarted: "
          f"{'restarting the worker group' in stack.output()}")
    assert greedy(stack.gateway) == before


@pytest.mark.timeout(240)
def test_killed_rank_heals_within_a_minute_with_the_same_outputs(stack):
    wait_until(lambda: serves(stack.gateway), 120, interval_s=0.5)
    before = greedy(stack.gateway)
    old = stack.child_pids()
    os.kill(old["worker1"], signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: stack.child_pids()["worker1"] != old["worker1"], HEAL_TIMEOUT_S)
    wait_until(lambda: serves(stack.gateway), HEAL_TIMEOUT_S - (time.monotonic() - killed_at),
               interval_s=0.5)
    print(f"serving again {time.monotonic() - killed_at:.1f}s after SIGKILL of rank 1")
    assert greedy(stack.gateway) == before
    assert "restarting the worker group" in stack.output()
    assert stack.launcher.poll() is None


@pytest.mark.timeout(120)
def test_sigterm_stops_every_process(stack):
    """Runs last in this module: it takes the shared stack down."""
    pids = stack.child_pids()
    assert set(pids) == {"worker0", "worker1", "router", "gateway"}
    stack.launcher.send_signal(signal.SIGTERM)
    assert stack.launcher.wait(timeout=60) == 0
    assert "[radixserve] stopped" in stack.output()
    assert wait_gone(list(pids.values())) == []
