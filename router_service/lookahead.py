"""Overlap scheduling: the router plans and sends step N+1 while the workers run step N.

A request whose step-N entry samples has a token in flight (`Request.num_unresolved`). Its
step-N+1 entry does not carry that token: it says "the token rank 0 sampled for this request in
task N" (`TaskEntry.sampled_in_task`), and every rank resolves it before running N+1 (rank 0
from its own result, the other ranks from rank 0's broadcast; see `worker_service.sampled_tokens`).

When N's tokens come back, everything that depends on them is decided one step late: a request
that ended in N (EOS, a stop id, `max_tokens`, the context, a cancellation) or was retracted has
work in N+1 that no longer belongs to it. That work is stale (`ScheduledEntry.is_stale`): its
token is discarded, what it wrote never enters the cache (pages are given back by
`Request.num_written`, which leaves out steps in flight), and the release of the request goes
with N+2, after N+1 on every rank. A request whose token in flight certainly ends it
(`Request.ends_when_resolved`) gets no step N+1 entry at all.

At most one step runs ahead: the engine sends N+1, then waits for N. A step may run ahead of
another only when `StepPlan.allows_lookahead` (every request's next position is known before
its result: not so for a step verifying draft tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.v1 import worker_pb2
from router_service.core.step_plan import StepPlan


@dataclass(slots=True, eq=False)
class InFlightStep:
    """A task sent to every rank whose result is not back yet."""

    plan: StepPlan
    task: worker_pb2.DecodeTask
    # When the engine began planning it (time.monotonic()), and the CPU time planning took.
    started: float
    plan_cpu_s: float
    # Sent with the step before it still running, or right after it: the ranks' idle time
    # before it is a cost of the router, not a lack of work.
    back_to_back: bool

    def may_run_ahead(self, overlap: bool) -> bool:
        """Whether the next step may be sent before this one's result is back."""
        return overlap and self.plan.allows_lookahead
