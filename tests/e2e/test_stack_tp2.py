"""The whole system at TP=2 (two gloo worker ranks), started with `radixserve up`: greedy
chat output equals transformers'; a frozen rank (0, which hosts the rendezvous store, or 1)
fails in-flight requests within the peer timeout, its group is killed and restarted at once (so
it serves again within the peer timeout plus the group's start time); a killed rank's group is restarted by the
launcher; SIGTERM stops every process (last: ends the stack).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from e2e.faults import RecordedStream, greedy, serves, wait_until
from e2e.parity import check_greedy_parity
from e2e.reference import CHATS
from e2e.stack import launch, wait_gone
from procs import ServiceProcesses, is_serving

# Short deadlines so that faults show within seconds (the defaults are minutes-safe). The step
# deadline is longer than the peer timeout: a freeze must be caught by the heartbeats.
STEP_TIMEOUT_S = 30.0
PEER_TIMEOUT_S = 5.0
# Long, so that a launcher that waited for a frozen rank to act on SIGTERM would show.
SHUTDOWN_TIMEOUT_S = 60.0
FAULT_ENV = {
    "RADIXSERVE_STEP_TIMEOUT_S": str(STEP_TIMEOUT_S),
    "RADIXSERVE_PEER_TIMEOUT_S": str(PEER_TIMEOUT_S),
    "RADIXSERVE_COLLECTIVE_TIMEOUT_S": "20",
    "RADIXSERVE_PROBE_INTERVAL_S": "0.5",
    "RADIXSERVE_RECONNECT_INTERVAL_S": "0.5",
}
# The bound for a lost rank: serving again with no action.
HEAL_TIMEOUT_S = 60.0
# A worker group's start (rendezvous, loading) on two busy cores.
GROUP_START_TIMEOUT_S = 240.0
# A heartbeat round (a quarter of the timeout), the router noticing the stream end, gateway
# probing (0.5 s) and one health call of slack.
DETECTION_SLACK_S = 4.0


@pytest.fixture(scope="module")
def stack(smollm2_dir):
    with ServiceProcesses() as procs:
        # Deterministic numerics: answers must not depend on what shares a step (issue 34's
        # "a recovered replica answers exactly as before", docs/determinism.md).
        yield launch(procs, smollm2_dir, tp=2, env=FAULT_ENV,
                     extra_args=["--shutdown-timeout-s", str(SHUTDOWN_TIMEOUT_S), "--deterministic"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(CHATS)))
def test_greedy_chat_matches_transformers(stack, references, index):
    check_greedy_parity(stack.gateway, index, references[index])


@pytest.mark.timeout(420)
@pytest.mark.parametrize("rank", [0, 1])
def test_frozen_rank_is_caught_within_the_peer_timeout_and_its_group_restarted(stack, rank):
    wait_until(lambda: serves(stack.gateway), 120, interval_s=0.5)
    before = greedy(stack.gateway)
    frozen = stack.child_pids()[f"worker{rank}"]
    stream = RecordedStream(stack.gateway, max_tokens=400).start()
    assert stream.started.wait(60) and stream.code is None
    restarts = stack.output().count("restarting the worker group")
    os.kill(frozen, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        assert stream.done.wait(PEER_TIMEOUT_S + DETECTION_SLACK_S + 5)
        assert stream.code == grpc.StatusCode.UNAVAILABLE
        assert stream.ended_at - frozen_at < PEER_TIMEOUT_S + DETECTION_SLACK_S
        wait_until(lambda: not is_serving(stack.gateway, timeout_s=0.5),
                   PEER_TIMEOUT_S + DETECTION_SLACK_S - (time.monotonic() - frozen_at))
        not_serving_s = time.monotonic() - frozen_at
        # The launcher restarts the group as soon as the rank that noticed leaves, killing the
        # frozen one at once (a SIGTERM would wait --shutdown-timeout-s for it).
        wait_until(lambda: stack.output().count("restarting the worker group") > restarts,
                   PEER_TIMEOUT_S + DETECTION_SLACK_S - (time.monotonic() - frozen_at), interval_s=0.1)
        restart_s = time.monotonic() - frozen_at
        assert wait_gone([frozen], 5) == []
        # Then serving again after the group's start (no SIGCONT needed).
        wait_until(lambda: serves(stack.gateway), GROUP_START_TIMEOUT_S, interval_s=0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGCONT)
    print(f"rank {rank} frozen: UNAVAILABLE after {stream.ended_at - frozen_at:.1f}s, gateway "
          f"NOT_SERVING after {not_serving_s:.1f}s, group restarted after {restart_s:.1f}s, "
          f"serving again after {time.monotonic() - frozen_at:.1f}s")
    assert greedy(stack.gateway) == before


# Longer than two KV pages, so that the answer's prefix is in the radix cache before the fault.
CACHED_PROMPT = ("Geography quiz. Answer with one word only, and say nothing else at all. "
                 "Question: which city is the capital of France? The capital of France is")
# Requests sent at once when the gateway reports SERVING again.
FIRST_REQUESTS = 8


@pytest.mark.timeout(300)
def test_killed_rank_group_restarts_and_answers_exactly_as_before(stack, references):
    """Nothing the old group computed is used by the new one: a prompt cached before SIGKILL
    and chats the new group never saw answer as before (the chats: as transformers); every
    request sent once the gateway is SERVING again succeeds, and those sent together answer
    exactly as the same prompt did alone before the fault (bit-identical numerics whatever shares
    the step: `--deterministic`)."""
    wait_until(lambda: serves(stack.gateway), 120, interval_s=0.5)
    before = greedy(stack.gateway, prompt=CACHED_PROMPT)
    assert greedy(stack.gateway, prompt=CACHED_PROMPT) == before  # now from the cache
    alone = greedy(stack.gateway, max_tokens=4)
    old = stack.child_pids()
    os.kill(old["worker1"], signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: not is_serving(stack.gateway, timeout_s=0.5), PEER_TIMEOUT_S, interval_s=0.1)
    wait_until(lambda: is_serving(stack.gateway, timeout_s=0.5), HEAL_TIMEOUT_S, interval_s=0.1)
    serving_s = time.monotonic() - killed_at
    with ThreadPoolExecutor(FIRST_REQUESTS) as pool:
        first = list(pool.map(lambda _: greedy(stack.gateway, max_tokens=4), range(FIRST_REQUESTS)))
    assert all(tokens == alone for tokens in first), (alone, first)
    print(f"serving again {serving_s:.1f}s after SIGKILL of rank 1; {FIRST_REQUESTS} requests "
          "sent at once then all succeeded")
    assert greedy(stack.gateway, prompt=CACHED_PROMPT) == before
    for index in range(len(CHATS)):
        check_greedy_parity(stack.gateway, index, references[index])
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
