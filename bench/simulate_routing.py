"""Routing policies for N model replicas, simulated over the real router core.

    python -m bench.simulate_routing                    # 8, 64 and 512 replicas (a few minutes)
    python -m bench.simulate_routing --replicas 8 --requests-per-replica 50
    RADIXSERVE_RECOMPUTE_TOKENS=0 python -m bench.simulate_routing --replicas 512 --loads 0.7 \
        --policy "bounded load" --decision-prompts 0   # one policy, a gateway setting changed

Each replica is the router's own `Scheduler` (radix cache, page allocator, step builder; no
model): a step runs the plan the scheduler makes, for as long as the step-time model says, and
then feeds back the answer tokens the trace drew (bench/routing_trace.py). The policies
(bench/routing_policies.py) see every replica's outstanding requests at each arrival.

Step-time model, fitted to `bench_worker` on one H100 (docs/benchmarks.md, "On a GPU": SmolLM2-135M's
shape, bfloat16, decode at 1,024 positions): decode x1 882.3 tok/s and x128 38,921.0 tok/s give
a fixed cost per step and a cost per decode row; prefill of 2,048 tokens at 180,637.3 tok/s, less
that fixed cost, gives a cost per prefill token.

Capacity: the requests per second one replica completes on the scale's trace when requests
arrive faster than it serves them (`capacity_per_replica`); a run at load L offers
L x capacity x replicas. For each policy, scale and load it prints the prompt tokens served from
the cache, TTFT p50 / p99 (from arrival to the step that samples the first token), busiest/mean
(each replica's outstanding requests, running plus waiting, integrated over time from the start
to the last arrival, the same code for every policy; the largest of those integrals over their
mean), the mean itself (per replica, over that time), the share of turns that continued a
session, the hit rate over the second half of the arrivals (the replicas' caches warm), copies
(the (replica, system prompt) pairs the policy made, over the system prompts seen: each pair is
one replica computing that prompt once) and moved (the continued turns sent to another replica
than the session's turn before, which recomputes the history there), and the ceiling (the best hit
rate any policy could reach on that run with busiest/mean within the goal's 1.25: each system
prompt computed once on each replica its load needs, bench/routing_ceiling.py); then the issue's
goals for bounded-load affinity as
ratios, which count the whole trace, and the second half's hit-rate ratios beside them. Last,
the cost of one routing decision at 8 and 512 replicas (no memo: every affinity decision hashes
the prompt's key and mixes it with every replica's own hash; the bounded-load policy also hashes
the prompt for its prefix memory; the total load is kept, not summed).

The trace is scaled down with the fleet (fewer requests per replica at 512) to keep the run
to minutes: at 512 replicas it ends before most sessions come back for a second turn (see the
continued column), so that scale measures mostly the system prompts' sharing, and every run
starts from empty replicas: until the fleet's load has built up, a bound relative to the mean
admits only a request or two per replica, so a bounded policy spreads each prompt over more
replicas than its steady load needs, and each of them computes it once. The shorter the trace
per replica, the larger that warm-up's share of the whole trace's hit rate.
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bench.routing_ceiling import Served, hit_rate_ceiling
from bench.routing_policies import POLICIES, BoundedLoad, Loads, PrefixAffinity, RoundRobin
from bench.routing_trace import TraceConfig, TraceSource, Turn
from gateway_service.config import config_from_args
from router_service.core.admission import Policy
from router_service.core.request import Request
from router_service.core.scheduler import Scheduler
from router_service.core.step_plan import StepPlan

# bench_worker on one H100 (docs/benchmarks.md, "On a GPU"), tokens per second.
DECODE_X1_TOKENS_PER_S = 882.3
DECODE_X128_TOKENS_PER_S = 38921.0
PREFILL_2048_TOKENS_PER_S = 180637.3
# A step: a fixed cost, plus one per decode row, plus one per prefill token. The decode figures
# were taken at 1,024 positions; attention's growth with the context is left out.
_DECODE_X1_S = 1 / DECODE_X1_TOKENS_PER_S
DECODE_ROW_S = (128 / DECODE_X128_TOKENS_PER_S - _DECODE_X1_S) / 127
STEP_FIXED_S = _DECODE_X1_S - DECODE_ROW_S
PREFILL_TOKEN_S = (2048 / PREFILL_2048_TOKENS_PER_S - STEP_FIXED_S) / 2048

PAGE_SIZE = 16
# Leading tokens that name a turn's system prompt (the trace's are longer, and random).
SYSTEM_KEY_TOKENS = 64
DEFAULT_SCALES = {8: 250, 64: 60, 512: 16}  # replicas: requests per replica
CALIBRATION_REQUESTS = 300
BUSIEST_GOAL = 1.25  # the issue's: busiest replica's load over the mean, whatever the bounds


def step_seconds(plan: StepPlan) -> float:
    seconds = STEP_FIXED_S
    for entry in plan.entries:
        seconds += DECODE_ROW_S if entry.num_tokens == 1 else PREFILL_TOKEN_S * entry.num_tokens
    return seconds


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """One replica's router settings (the router's defaults but for the pool, a choice: small
    enough that one replica cannot keep every system prompt and history of a large fleet)."""

    num_pages: int = 2048
    max_batch_tokens: int = 2048
    max_running_requests: int = 64
    context_len: int = 8192

    def scheduler(self) -> Scheduler:
        return Scheduler(
            num_pages=self.num_pages, page_size=PAGE_SIZE, max_batch_tokens=self.max_batch_tokens,
            max_running_requests=self.max_running_requests, policy=Policy.LPM,
            context_len=self.context_len, eos_token_ids=frozenset({0}),
        )


@dataclass(slots=True)
class RunResult:
    policy: str
    num_requests: int
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    busiest_over_mean: float
    makespan_s: float
    continued_share: float
    num_completed: int
    mean_load: float  # outstanding requests per replica, averaged while requests arrive
    late_hit_rate: float  # over the second half of the arrivals: the replicas' caches warm
    prompt_copies: float  # (replica, system prompt) pairs routed over system prompts seen
    moved_share: float  # of continued turns, those sent to another replica than the turn before
    hit_ceiling: float  # the best hit rate with busiest/mean within BUSIEST_GOAL (bench/routing_ceiling.py)

    @property
    def completed_per_s(self) -> float:
        return self.num_requests / self.makespan_s


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def simulate(policy, num_replicas: int, num_requests: int, rate_per_s: float, trace: TraceConfig,
             replica: ReplicaConfig, seed: int) -> RunResult:
    """Route `num_requests` arrivals of the trace over `num_replicas`; run until all are done."""
    schedulers = [replica.scheduler() for _ in range(num_replicas)]
    source = TraceSource(trace, rate_per_s, seed)
    loads = Loads(num_replicas)
    load_area = [0.0] * num_replicas  # outstanding requests integrated over time
    load_since = [0.0] * num_replicas
    busy = [False] * num_replicas
    in_flight: dict[int, StepPlan] = {}
    turns: dict[str, Turn] = {}
    ttft: list[float] = []
    late: list[Request] = []  # the second half of the arrivals
    # Where each system prompt (its first tokens) and each session's last turn went.
    prompt_replicas: set[tuple[tuple[int, ...], int]] = set()
    last_replica: dict[int, int] = {}
    system_lens: dict[tuple[int, ...], int] = {}  # each system prompt seen, its length
    served: list[tuple[tuple[int, ...], int, float]] = []  # per request: its system prompt, tokens shared, arrival
    finished_s: dict[str, float] = {}
    num_moved = 0
    steps: list[tuple[float, int]] = []  # (finish time, replica) of the steps running
    num_arrived = num_continued = num_completed = 0
    now = makespan_s = last_arrival_s = 0.0

    def set_load(index: int, delta: int) -> None:
        # Loads are averaged while requests arrive: the drain after the last one is not load.
        if num_arrived < num_requests:
            load_area[index] += loads[index] * (now - load_since[index])
            load_since[index] = now
        loads.add(index, delta)

    def start_step(index: int) -> None:
        plan = schedulers[index].schedule()
        if plan.ended:
            raise RuntimeError(f"replica {index} failed requests: {[r.request_id for r in plan.ended]}")
        busy[index] = bool(plan.entries)
        if plan.entries:
            in_flight[index] = plan
            heapq.heappush(steps, (now + step_seconds(plan), index))
        elif schedulers[index].waiting:
            raise RuntimeError(f"replica {index} admits nothing with nothing running")

    while num_arrived < num_requests or steps:
        if steps and (num_arrived == num_requests or steps[0][0] <= source.next_arrival_s):
            now, index = heapq.heappop(steps)
            plan = in_flight.pop(index)
            scheduler = schedulers[index]
            sampled = [turns[e.request.request_id].output_ids[e.request.num_output] for e in plan.entries if e.sample]
            for request in scheduler.complete(plan, sampled):
                turn = turns[request.request_id]
                if request.num_output == 1:
                    ttft.append(now - turn.arrival_s)
                if request.finish_reason is not None:
                    num_completed += 1
                    finished_s[request.request_id] = now
                    set_load(index, -1)
                    source.answered(turn)
            start_step(index)
            makespan_s = now
            continue
        now = last_arrival_s = source.next_arrival_s
        turn = source.take()
        request_id = str(num_arrived)
        turns[request_id] = turn
        num_continued += turn.continues_session
        index = policy.choose(turn.prompt_ids, loads)
        key = tuple(turn.prompt_ids[:SYSTEM_KEY_TOKENS])
        prompt_replicas.add((key, index))
        if turn.continues_session or key in system_lens:
            served.append((key, turn.shared_len, now))
        else:  # the first of its system prompt: nothing earlier to share
            system_lens[key] = turn.shared_len
            served.append((key, 0, now))
        num_moved += turn.continues_session and last_replica[id(turn.session)] != index
        last_replica[id(turn.session)] = index
        request = Request(request_id, turn.prompt_ids, max_tokens=len(turn.output_ids))
        schedulers[index].add(request)
        if num_arrived >= num_requests // 2:
            late.append(request)
        set_load(index, 1)
        if num_arrived == num_requests - 1:  # the last arrival: close the averages
            for other in range(num_replicas):
                set_load(other, 0)
        num_arrived += 1
        if not busy[index]:
            start_step(index)
    prompt_tokens = sum(s.stats.prompt_tokens for s in schedulers)
    hit_tokens = sum(s.stats.cache_hit_tokens for s in schedulers)
    num_prompts_seen = len({key for key, _ in prompt_replicas})
    ceiling = hit_rate_ceiling(
        (Served(key, system_lens[key], len(turns[str(number)].prompt_ids), shared_len,
                min(finished_s.get(str(number), last_arrival_s), last_arrival_s) - arrival_s)
         for number, (key, shared_len, arrival_s) in enumerate(served)),
        num_replicas, BUSIEST_GOAL, PAGE_SIZE)
    return RunResult(
        policy.name, num_requests, hit_tokens / prompt_tokens, _percentile(ttft, 0.5),
        _percentile(ttft, 0.99), max(load_area) / statistics.mean(load_area), makespan_s,
        num_continued / num_requests, num_completed, statistics.mean(load_area) / last_arrival_s,
        sum(r.num_cached_tokens for r in late) / sum(r.num_prompt for r in late),
        len(prompt_replicas) / num_prompts_seen, num_moved / max(num_continued, 1), ceiling,
    )


def trace_for(num_replicas: int) -> TraceConfig:
    """More agents in a larger fleet: twice as many system prompts as replicas, at least 64."""
    return TraceConfig(num_system_prompts=max(64, 2 * num_replicas))


def capacity_per_replica(trace: TraceConfig, replica: ReplicaConfig, seed: int) -> float:
    """Requests per second one replica completes when requests arrive faster than it serves
    them: first all at once (no session has an answer yet, so no turn resends a history), then
    at twice that rate, long enough for sessions to come back as they do in the runs."""
    flood = simulate(RoundRobin(1), 1, CALIBRATION_REQUESTS, 1e6, trace, replica, seed)
    overload = 2 * flood.completed_per_s
    return simulate(RoundRobin(1), 1, 3 * CALIBRATION_REQUESTS, overload, trace, replica, seed).completed_per_s


def decision_microseconds(policy_class, num_replicas: int, prompts: Sequence[list[int]], repeats: int = 3) -> float:
    """Mean cost of one `choose` over `prompts` (a fresh policy, no memo, loads spread over the
    replicas), the best of `repeats` runs: the machine's other work only ever adds to it."""
    best = float("inf")
    for _ in range(repeats):
        if issubclass(policy_class, PrefixAffinity):
            policy = policy_class(num_replicas, memo=False)
        else:
            policy = policy_class(num_replicas)
        loads = Loads(num_replicas)
        for index in range(num_replicas):
            loads.add(index, (index * 7) % 23)
        started = time.perf_counter()
        for prompt in prompts:
            policy.choose(prompt, loads)
        best = min(best, (time.perf_counter() - started) / len(prompts) * 1e6)
    return best


def _print_goals(results: dict[str, RunResult]) -> None:
    """The issue's goals for bounded-load affinity, as ratios from this run."""
    mine, affinity, aware = results["bounded load"], results["prefix affinity"], results["cache aware"]

    def verdict(met: bool) -> str:
        return "met" if met else "NOT met"

    hit = mine.hit_rate / affinity.hit_rate
    p99 = mine.ttft_p99_s / affinity.ttft_p99_s
    print(f"      bounded load vs prefix affinity: hit rate {hit:.2f}x (goal >= 0.95x: {verdict(hit >= 0.95)}), "
          f"TTFT p99 {p99:.2f}x (goal <= 0.5x: {verdict(p99 <= 0.5)}); busiest/mean {mine.busiest_over_mean:.2f} "
          f"(goal <= {BUSIEST_GOAL}: {verdict(mine.busiest_over_mean <= BUSIEST_GOAL)})")
    p99 = mine.ttft_p99_s / aware.ttft_p99_s
    hit = mine.hit_rate / aware.hit_rate
    print(f"      bounded load vs cache aware: TTFT p99 {p99:.2f}x at hit rate {hit:.2f}x "
          f"(goal: < 1x at >= 1x: {verdict(p99 < 1 and hit >= 1)})")
    print(f"      second half of the trace (caches warm), hit rate: {mine.late_hit_rate / affinity.late_hit_rate:.2f}x "
          f"prefix affinity's, {mine.late_hit_rate / aware.late_hit_rate:.2f}x cache aware's")
    print(f"      hit-rate ceiling with busiest/mean <= {BUSIEST_GOAL} (each run's own; the ceiling column): bounded "
          f"load {mine.hit_rate / mine.hit_ceiling:.3f}x its run's, cache aware {aware.hit_rate / aware.hit_ceiling:.3f}x "
          f"its run's, prefix affinity {affinity.hit_rate / affinity.hit_ceiling:.3f}x its run's")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", default=",".join(map(str, DEFAULT_SCALES)),
                        help="comma-separated replica counts")
    parser.add_argument("--requests-per-replica", type=int, default=0,
                        help="trace length per replica (0: 250 at 8, 60 at 64, 16 at 512)")
    parser.add_argument("--loads", default="0.7,0.9", help="offered load, as fractions of capacity")
    parser.add_argument("--bound", type=float, default=None,
                        help="bounded-load c (default: the gateway's --load-bound)")
    parser.add_argument("--pages", type=int, default=ReplicaConfig().num_pages, help="KV pages per replica")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--policy", action="append", choices=[policy.name for policy in POLICIES],
                        help="a policy to run, once per policy (default: all; the goals print when bounded load, "
                             "prefix affinity and cache aware all run)")
    parser.add_argument("--decision-prompts", type=int, default=500,
                        help="prompts timed per policy and scale (0: no timing)")
    args = parser.parse_args(argv)
    policies = [policy for policy in POLICIES if args.policy is None or policy.name in args.policy]
    # The bounded-load policies route with the gateway's settings as a gateway would read them
    # from its RADIXSERVE_* variables (its defaults where none is set), `--bound` over its load bound.
    gateway = config_from_args([])
    replica = ReplicaConfig(num_pages=args.pages)
    bounded = BoundedLoad(1, bound=args.bound, gateway=gateway).bounds
    print(f"step model: {STEP_FIXED_S * 1e3:.3f} ms + {DECODE_ROW_S * 1e6:.2f} us per decode row + "
          f"{PREFILL_TOKEN_S * 1e6:.2f} us per prefill token (bench_worker, H100); "
          f"{replica.num_pages} pages of {PAGE_SIZE} per replica; bounded-load c = {bounded.load} (prefix "
          f"memory: {gateway.prefix_memory_holders} replicas per prefix, bound {bounded.memory} for a shared "
          f"prefix's, {bounded.session} for a conversation's history; {bounded.recompute_tokens} prompt tokens to "
          f"recompute per request of load, 0: none)")
    started = time.perf_counter()
    for num_replicas in (int(part) for part in args.replicas.split(",")):
        per_replica = args.requests_per_replica or DEFAULT_SCALES.get(num_replicas, 60)
        trace = trace_for(num_replicas)
        capacity = capacity_per_replica(trace, replica, args.seed)
        print(f"\n{num_replicas} replicas, {per_replica * num_replicas} requests, "
              f"{trace.num_system_prompts} system prompts; capacity {capacity:.1f} requests/s per replica")
        print(f"{'load':>5} {'policy':<16} {'hit rate':>8} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
              f"{'busiest/mean':>12} {'mean load':>9} {'continued':>9} {'2nd half hit':>12} {'copies':>6} {'moved':>5} "
              f"{'ceiling':>7}")
        for load in (float(part) for part in args.loads.split(",")):
            results = {}
            for policy_class in policies:
                if issubclass(policy_class, BoundedLoad):
                    policy = policy_class(num_replicas, bound=args.bound, gateway=gateway)
                else:
                    policy = policy_class(num_replicas)
                result = results[policy.name] = simulate(
                    policy, num_replicas, per_replica * num_replicas, load * capacity * num_replicas,
                    trace, replica, args.seed,
                )
                print(f"{load:>5.0%} {result.policy:<16} {result.hit_rate:>8.1%} {result.ttft_p50_s * 1e3:>11.1f} "
                      f"{result.ttft_p99_s * 1e3:>11.1f} {result.busiest_over_mean:>12.2f} "
                      f"{result.mean_load:>9.1f} {result.continued_share:>9.0%} {result.late_hit_rate:>12.1%} "
                      f"{result.prompt_copies:>6.2f} {result.moved_share:>5.0%} {result.hit_ceiling:>7.1%}",
                      flush=True)
            if {"bounded load", "prefix affinity", "cache aware"} <= results.keys():
                _print_goals(results)
    if not args.decision_prompts:
        return
    source = TraceSource(trace_for(512), 1.0, args.seed)
    prompts = [source.take().prompt_ids for _ in range(args.decision_prompts)]
    print(f"\nmicroseconds per routing decision (no memo; mean over {len(prompts)} prompts, best of 3):")
    for policy_class in POLICIES:
        costs = [decision_microseconds(policy_class, n, prompts) for n in (8, 512)]
        print(f"  {policy_class.name:<16} 8 replicas {costs[0]:8.1f}   512 replicas {costs[1]:8.1f}")
    print(f"\n(simulated in {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
