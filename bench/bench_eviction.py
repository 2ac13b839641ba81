"""Cost of one prefix-cache eviction with 100k cached pages: before and after the LRU leaf queue.

    .venv/bin/python -m bench.bench_eviction [--num-pages 100000] [--leaf-pages 4] [--calls 2000]

Builds two identical radix caches holding `--num-pages` unlocked pages (groups of sequences that
share a prefix, like requests sharing a system prompt; every leaf `--leaf-pages` pages long), then
times `evict(1)`, the eviction a decode at a page boundary needs:
- before: the algorithm the cache had until the LRU queue (`evict_by_scan` below, kept only here
  as the baseline): walk every leaf, heap the unlocked ones, pop the least recently used;
- after: `RadixCache.evict`, which pops its queue of evictable leaves (O(log n)).
Rounds alternate the two (the machine may be shared: neighbouring rounds see the same load); each
figure is the median over rounds of the mean per call. The scheduler used to hide the scan by
evicting 1/256 of the pool per call; that batch is timed too, per page it freed.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from router_service.core.radix_cache import RadixCache, RadixNode  # noqa: E402

PAGE_SIZE = 16  # the workers' default
# Pages of the prefix each group of sequences shares, and sequences per group.
SHARED_PREFIX_PAGES = 8
SEQUENCES_PER_PREFIX = 16
# The share of the pool the scheduler evicted per call before the LRU queue.
OLD_EVICT_BATCH_FRACTION = 1 / 256
VOCAB = 49152
# Defaults: the 100k pages; enough calls that a per-call mean is steady.
NUM_PAGES = 100_000
LEAF_PAGES = 4
CALLS = 2000
BASELINE_CALLS = 20  # the walk takes milliseconds: fewer calls
ROUNDS = 5


def build_cache(num_pages: int, leaf_pages: int, seed: int) -> RadixCache:
    """A cache holding `num_pages` unlocked pages in groups that share a prefix."""
    rng = random.Random(seed)
    cache = RadixCache(PAGE_SIZE)
    next_page = 0
    while next_page < num_pages:
        prefix = [rng.randrange(VOCAB) for _ in range(SHARED_PREFIX_PAGES * PAGE_SIZE)]
        for _ in range(SEQUENCES_PER_PREFIX):
            tokens = prefix + [rng.randrange(VOCAB) for _ in range(leaf_pages * PAGE_SIZE)]
            num_cached = cache.match_prefix(tokens).matched_len // PAGE_SIZE
            num_new = min(len(tokens) // PAGE_SIZE - num_cached, num_pages - next_page)
            if num_new <= 0:
                break
            tokens = tokens[: (num_cached + num_new) * PAGE_SIZE]
            page_ids = list(range(next_page - num_cached, next_page + num_new))  # first ones unused
            cache.insert(tokens, page_ids)
            next_page += num_new
    return cache


def evict_by_scan(cache: RadixCache, num_pages: int) -> list[int]:
    """The eviction before the LRU queue: every call walks all leaves (baseline only; it leaves
    the cache's own queue and counters stale, so a cache it ran on serves nothing else)."""
    size = cache.page_size
    leaves: list[RadixNode] = []
    stack = list(cache.root.children.values())
    while stack:
        node = stack.pop()
        if node.children:
            stack.extend(node.children.values())
        else:
            leaves.append(node)
    heap = [(leaf.last_access, id(leaf), leaf) for leaf in leaves if leaf.lock_ref == 0]
    heapq.heapify(heap)
    freed: list[int] = []
    while heap and len(freed) < num_pages:
        _, _, leaf = heapq.heappop(heap)
        take = min(num_pages - len(freed), len(leaf.page_ids))
        if take < len(leaf.page_ids):
            freed.extend(leaf.page_ids[-take:])
            del leaf.page_ids[-take:]
            del leaf.key[-take * size :]
            break
        freed.extend(leaf.page_ids)
        parent = leaf.parent
        assert parent is not None
        del parent.children[tuple(leaf.key[:size])]
        if parent is not cache.root and not parent.children and parent.lock_ref == 0:
            heapq.heappush(heap, (parent.last_access, id(parent), parent))
    return freed


def per_call_s(evict: Callable[[int], list[int]], num_pages: int, calls: int) -> float:
    """Mean seconds per `evict(num_pages)` over `calls` calls; checks each freed what it should."""
    started = time.perf_counter()
    for _ in range(calls):
        if len(evict(num_pages)) != num_pages:
            raise RuntimeError("the cache ran out of pages: use fewer --calls")
    return (time.perf_counter() - started) / calls


def measure(num_pages: int = NUM_PAGES, leaf_pages: int = LEAF_PAGES, calls: int = CALLS,
            baseline_calls: int = BASELINE_CALLS, rounds: int = ROUNDS) -> dict[str, float]:
    """Median seconds per call of each eviction, one cache each, rounds alternating."""
    batch = max(1, int(num_pages * OLD_EVICT_BATCH_FRACTION))
    if rounds * max(calls, baseline_calls * batch) > num_pages // 2:
        raise SystemExit(f"{rounds} rounds would evict over half of the {num_pages} pages: use fewer calls")
    new, old, old_batched = (build_cache(num_pages, leaf_pages, seed=0) for _ in range(3))
    num_leaves = len(new.evictable_leaves())
    times: dict[str, list[float]] = {"before": [], "after": [], "before_batched": []}
    for _ in range(rounds):
        times["before"].append(per_call_s(lambda n: evict_by_scan(old, n), 1, baseline_calls))
        times["after"].append(per_call_s(new.evict, 1, calls))
        times["before_batched"].append(
            per_call_s(lambda n: evict_by_scan(old_batched, n), batch, baseline_calls))
    result = {name: statistics.median(values) for name, values in times.items()}
    return {**result, "batch_pages": batch, "num_leaves": num_leaves, "num_pages": num_pages}


def report_lines(result: dict[str, float]) -> list[str]:
    before, after, batched = result["before"], result["after"], result["before_batched"]
    batch = int(result["batch_pages"])
    return [
        f"eviction with {int(result['num_pages'])} cached pages ({int(result['num_leaves'])} leaves), page size {PAGE_SIZE}:",
        f"  before (walk every leaf):      {before * 1e6:10.1f} us per evict(1)",
        f"  after  (LRU leaf queue):       {after * 1e6:10.1f} us per evict(1)   {before / after:8.0f}x faster",
        f"  before, batched as the scheduler did ({batch} pages per call): {batched * 1e6:.1f} us per call"
        f" = {batched / batch * 1e6:.1f} us per page ({batched / batch / after:.1f}x the new evict(1))",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-pages", type=int, default=NUM_PAGES, help="pages in the cache")
    parser.add_argument("--leaf-pages", type=int, default=LEAF_PAGES, help="pages of each sequence's own leaf")
    parser.add_argument("--calls", type=int, default=CALLS, help="evict(1) calls per round, after")
    parser.add_argument("--baseline-calls", type=int, default=BASELINE_CALLS,
                        help="calls per round, before (each walks the whole tree)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="alternating rounds; medians are reported")
    args = parser.parse_args()
    result = measure(args.num_pages, args.leaf_pages, args.calls, args.baseline_calls, args.rounds)
    print("\n".join(report_lines(result)))


if __name__ == "__main__":
    main()
