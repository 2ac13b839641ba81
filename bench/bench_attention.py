"""The compiled paged attention kernel alone, one layer per call, against this machine's bounds.

Shapes of the speed issue's workloads with SmolLM2's heads (9 query, 3 KV, head size 64), in
bfloat16 (`--dtype` for float32 or float16), pages of 16 shuffled over a pool held on 2 MiB pages
as the worker's is; each case is called in turn on copies of itself on other pages, ~96 MB of K
and V in all, so that K and V come from memory as a model's layers find them:

- shared: 32 decode rows behind one 992-token prefix (the prefix's group) plus 40 keys each;
- unshared: 32 decode rows of 1,024 keys each;
- one row: a single decode row of 1,024 keys;
- prefill behind a prefix: 31 prompts of 25 tokens after 944 cached tokens (the step that follows
  a shared prefix's prefill).

Each figure is the best time of a call over `--repeats` rounds, with its fraction of the bound:
the larger of (FLOPs: q.k and p.v over every key each query sees / bfloat16 GEMM throughput) and
(bytes: the K and V pages read, a shared prefix once / read bandwidth), both bounds measured at the
start and the end of the run (`bench.bounds`), the larger counting; the GEMM throughput is the
dtype's (the worker's linear layer: a float16 one multiplies in float32 on a CPU without a
float16 GEMM).
`python -m bench.bench_attention [--dtype bfloat16] [--threads 2] [--repeats 5] [--calls 200] [--cycle-mb 96]`
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch

from bench import bounds as machine
from worker_service import native
from worker_service.attention.decode_plan import shared_prefixes
from worker_service.kv_pool import advise_huge_pages

PAGE_SIZE, HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS = 16, 64, 3, 9
CYCLE_MB = 96  # each case cycles through copies on other pages, past any last-level cache
MAX_COPIES = 32


@dataclass
class Case:
    name: str
    tables: list[list[int]]
    lens: list[int]
    spans: list[tuple[int, int, int, list[int]]]  # (first row, rows, start, pages)
    num_rows: int
    flops: float
    bytes: float


PER_KEY_FLOPS = NUM_Q_HEADS * HEAD_DIM * 4  # q.k and p.v: two multiply-adds per dimension and head
PAGE_BYTES = PAGE_SIZE * HEAD_DIM * 2 * 2 * NUM_KV_HEADS  # K and V, bfloat16, every KV head (see `scaled`)


def shared(take) -> Case:
    prefix = take(62)
    tables = [prefix + take(3) for _ in range(32)]
    return Case("shared 32 x (992 + 40)", tables, [992 + 40] * 32, [], 32, 32 * 1032 * PER_KEY_FLOPS,
                (62 + 32 * 3) * PAGE_BYTES)


def unshared(take) -> Case:
    tables = [take(64) for _ in range(32)]
    return Case("unshared 32 x 1024", tables, [1024] * 32, [], 32, 32 * 1024 * PER_KEY_FLOPS, 32 * 64 * PAGE_BYTES)


def one_row(take) -> Case:
    return Case("one row x 1024", [take(64)], [1024], [], 1, 1024 * PER_KEY_FLOPS, 64 * PAGE_BYTES)


def prefill_behind_prefix(take) -> Case:
    prefix = take(59)
    spans, row, flops = [], 0, 0.0
    for _ in range(31):
        spans.append((row, 25, 944, prefix + take(2)))
        flops += sum(944 + i + 1 for i in range(25)) * PER_KEY_FLOPS
        row += 25
    return Case("prefill 31 x 25 behind 944", [], [], spans, row, flops, (59 + 31 * 2) * PAGE_BYTES)


BUILDERS = [shared, unshared, one_row, prefill_behind_prefix]


def copies_of_cases(cycle_bytes: int, seed: int = 0) -> tuple[list[list[Case]], int]:
    """Each case in as many copies on disjoint, shuffled pages as make `cycle_bytes` (at most
    MAX_COPIES), so that calls cycling through them read K and V from memory, as a model's layers
    do; and the pool's page count."""
    counter = iter(range(1 << 30))
    sizes = [build(lambda count: [next(counter) for _ in range(count)]).bytes for build in BUILDERS]
    num_copies = [min(MAX_COPIES, max(1, -(-cycle_bytes // int(size)))) for size in sizes]
    num_pages = sum(int(size // PAGE_BYTES) * n for size, n in zip(sizes, num_copies))
    order = list(range(num_pages))
    random.Random(seed).shuffle(order)
    free = iter(order)

    def take(count: int) -> list[int]:
        return [next(free) for _ in range(count)]

    return [[build(take) for _ in range(n)] for build, n in zip(BUILDERS, num_copies)], num_pages


def pool_like(num_pages: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random K or V of every KV head, on 2 MiB pages where Linux allows, as the worker's pool is."""
    tensor = torch.empty(NUM_KV_HEADS, num_pages * PAGE_SIZE, HEAD_DIM, dtype=dtype)
    advise_huge_pages(tensor)  # before the first touch
    return tensor.normal_(generator=torch.Generator().manual_seed(seed))


def time_case(kernel, copies: list[Case], k: torch.Tensor, v: torch.Tensor, calls: int, repeats: int) -> float:
    """Best seconds per call over `repeats` rounds of `calls` calls, cycling through the copies."""
    plans = [kernel.plan(case.tables, case.lens, PAGE_SIZE, shared_prefixes(case.tables, case.lens, PAGE_SIZE),
                         case.spans) for case in copies]
    q = torch.randn(copies[0].num_rows, NUM_Q_HEADS, HEAD_DIM).to(k.dtype)
    for plan in plans:
        plan.attend(q, k, v)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for call in range(calls):
            plans[call % len(plans)].attend(q, k, v)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch (and kernel) threads")
    parser.add_argument("--repeats", type=int, default=5, help="rounds per case; the best counts")
    parser.add_argument("--calls", type=int, default=200, help="calls per round")
    parser.add_argument("--cycle-mb", type=int, default=CYCLE_MB,
                        help="K and V each case cycles through (copies on other pages), in MB")
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16",
                        help="the pool's (and the queries') dtype")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = native.load()
    if kernel is None:
        raise SystemExit(f"the compiled kernel does not build here: {native.failure()}")
    dtype = getattr(torch, args.dtype)
    scaled = dtype.itemsize / 2  # the cases count bfloat16 bytes
    first = machine.measure([args.dtype])
    all_copies, num_pages = copies_of_cases(int((args.cycle_mb << 20) / scaled))
    k, v = pool_like(num_pages, dtype, 1), pool_like(num_pages, dtype, 2)
    timed = [(copies[0], time_case(kernel, copies, k, v, args.calls, args.repeats)) for copies in all_copies]
    bounds = machine.best_of(first, machine.measure([args.dtype]))
    flops_per_s, bytes_per_s = bounds.gemm_flops_per_s[args.dtype], bounds.bandwidth_bytes_per_s
    print(f"bounds (best of start and end): read bandwidth {bytes_per_s / 1e9:.1f} GB/s; "
          f"GEMM {args.dtype} {flops_per_s / 1e9:.0f} GFLOP/s; {args.threads} threads; one layer per call")
    for case, seconds in timed:
        case_bytes = case.bytes * scaled
        bound = max(case.flops / flops_per_s, case_bytes / bytes_per_s)
        kind = "FLOPs" if case.flops / flops_per_s >= case_bytes / bytes_per_s else "bytes"
        print(f"{case.name:>28}: {seconds * 1e6:8.1f} us a call, {case.flops / seconds / 1e9:6.1f} GFLOP/s, "
              f"{case_bytes / seconds / 1e9:5.1f} GB/s; {bound / seconds:4.0%} of its bound ({kind})")


if __name__ == "__main__":
    main()
